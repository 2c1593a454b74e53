"""The other methods' prompt templates (SPICE, SSP) load from prompts/methods/ and stay out of
`prompts.protocol_fingerprint`, which keys SCOPE's cached warm starts and held-out sets."""

from __future__ import annotations

import hashlib
from importlib import resources

import pytest

from scope_lib.protocol import prompts


def test_method_templates_are_registered_on_disk_apart_from_scopes():
    folder = resources.files("scope_lib.protocol").joinpath("prompts", "methods")
    on_disk = sorted(p.name[:-4] for p in folder.iterdir() if p.name.endswith(".txt"))
    assert on_disk == sorted(prompts.METHOD_TEMPLATE_NAMES)
    assert not set(prompts.METHOD_TEMPLATE_NAMES) & set(prompts.TEMPLATE_NAMES)
    for name in prompts.METHOD_TEMPLATE_NAMES:
        assert prompts.load_template(name).template == prompts.load_template(f"{name}.txt").template
        assert prompts.load_template(name).template.strip()


def test_the_protocol_fingerprint_reads_scopes_templates_only():
    reads: list[str] = []
    recorded: list[bytes] = []

    class Recorder:
        def __init__(self):
            self.inner = hashlib.sha256()

        def update(self, data: bytes) -> None:
            reads.append(data.split(b"\0", 1)[0].decode(errors="replace"))
            recorded.append(data)
            self.inner.update(data)

        def hexdigest(self) -> str:
            return self.inner.hexdigest()

    value = prompts.protocol_fingerprint(Recorder())
    assert value == prompts.protocol_fingerprint()
    named = [r for r in reads if r in prompts.TEMPLATE_NAMES or r in prompts.METHOD_TEMPLATE_NAMES]
    assert named == list(prompts.TEMPLATE_NAMES)     # every SCOPE template, in order, and no method template
    method_texts = [prompts.load_template(n).template.encode() for n in prompts.METHOD_TEMPLATE_NAMES]
    assert not any(text in data for text in method_texts for data in recorded)


def test_unknown_templates_name_both_lists():
    with pytest.raises(ValueError, match="unknown prompt template 'nope'.*challenger.*spice_challenger"):
        prompts.load_template("nope")


def test_render_template_fills_and_refuses_missing_values():
    assert "JSON fields" in prompts.render_template("spice_format_multiple_choice")
    with pytest.raises(ValueError, match="'ssp_rag_solver' needs a value for documents"):
        prompts.render_template("ssp_rag_solver", question="Q?")
