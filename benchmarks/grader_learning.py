"""Can the smoke model learn to grade by reading? Fine-tunes a copy of the warm-started tiny model on synthetic
grades and prints, every `--every` steps, how often its verdict on held-out grades is right.

    python benchmarks/grader_learning.py --steps 600 --lr 2e-3 --verdict-weight 10
    python benchmarks/grader_learning.py --prompt short --steps 600 --lr 2e-3 --verdict-weight 10
    python benchmarks/grader_learning.py --copy-steps 300 --steps 400 --lr 1e-3
    python benchmarks/grader_learning.py --short-steps 600 --steps 1000 --batch 32 --lr 4e-3 --verdict-weight 10

The grades are those of `protocol_check.grader_sensitivity` (`probe_case`): an answer "S is linked to A and B." against the
rubric "Mentions A." (held) or "Mentions D." (missed), balanced. The reply reasons first, as the grader prompt
asks: `<think>Mentions A found</think><score>1</score>` (or `missing` and 0), so the model can copy the rubric's
fact before it decides. Loss is on the reply's tokens, the verdict token's weighted by `--verdict-weight`; names
are swapped as in the warm start. `--prompt short` drops the grader template (response and rubric only);
`--short-steps K` trains the first K steps on the short prompt and the rest on the full one (a curriculum), and
prints the held-out accuracies on both. `--copy-steps` first trains on repeated random names (copy pre-training).
Nothing is saved: this measures what the warm start could teach the grader, for docs/smoke-model.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from scope_lib.config import load_params  # noqa: E402
from scope_lib.models.loading import load_model_and_tokenizer  # noqa: E402
from scope_lib.protocol import prompts  # noqa: E402
from scope_lib.protocol.facts import Names  # noqa: E402
from scope_lib.retrieval.corpus import read_corpus, teacher_split  # noqa: E402
from scope_lib.selfplay.judge import _encode_user  # noqa: E402
from scope_lib.smoke.protocol_check import probe_case  # noqa: E402
from scope_lib.smoke.teacher import swappable_names  # noqa: E402
from scope_lib.smoke.warm_start import warm_model_path  # noqa: E402


def grade_examples(documents, names: Names, encode, short: bool, rng: random.Random) -> list[tuple]:
    """(prompt ids, reply ids, holds) per document with four facts, the rubric's fact held or missed at random."""
    out = []
    for case in filter(None, (probe_case(doc, names) for doc in documents)):
        holds = rng.random() < 0.5
        fact = rng.choice(case.held) if holds else case.missing
        rubric = case.rubric(fact)
        prompt = (encode(f"<response>{case.answer}</response><rubric>{rubric}</rubric>") if short else
                  encode(prompts.grader_prompt(case.task, case.answer, rubric, native_thinking=False), user=True))
        reply = f"<think>Mentions {fact} {'found' if holds else 'missing'}</think><score>{int(holds)}</score>"
        out.append((prompt, encode(reply), holds))
    return out


def step_loss(model, batch: list[list[int]], reply_starts: list[int], weights: dict[int, float], pad: int):
    """Weighted cross-entropy over the replies' tokens, projecting only those positions through the LM head."""
    width = max(len(s) for s in batch)
    ids = torch.full((len(batch), width), pad)
    att = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (s, start) in enumerate(zip(batch, reply_starts, strict=True)):
        ids[i, width - len(s):], att[i, width - len(s):] = torch.tensor(s), 1
        if start is not None:
            labels[i, width - len(s) + start:] = torch.tensor(s[start:])
    hidden = model.model(input_ids=ids, attention_mask=att).last_hidden_state[:, :-1]
    targets = labels[:, 1:]
    mask = targets != -100
    logits = model.get_output_embeddings()(hidden[mask])
    per_token = torch.nn.functional.cross_entropy(logits, targets[mask], reduction="none")
    w = torch.ones_like(per_token)
    for token, weight in weights.items():
        w[targets[mask] == token] = weight
    return (per_token * w).sum() / w.sum()


@torch.no_grad()
def held_out(model, examples, found: int, missing: int) -> tuple[float, float, float]:
    """(verdict accuracy teacher-forced on the reply up to the verdict, fact-copy accuracy, verdict accuracy
    after the model's own greedy copy: what the Judge would write)."""
    model.eval()
    right = copied = own = 0
    for prompt, reply, holds in examples:
        logits = model(torch.tensor([prompt + reply[:3]])).logits[0]
        guess = int(logits[-2].argmax().item())
        copied += guess == reply[2]
        right += int((logits[-1, found] > logits[-1, missing]).item() == holds)
        if guess != reply[2]:
            logits = model(torch.tensor([prompt + reply[:2] + [guess]])).logits[0]
        own += int((logits[-1, found] > logits[-1, missing]).item() == holds)
    model.train()
    n = len(examples)
    return right / n, copied / n, own / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default=str(REPO / "params" / "smoke.yaml"))
    ap.add_argument("--prompt", choices=["full", "short"], default="full")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--verdict-weight", type=float, default=1.0)
    ap.add_argument("--copy-steps", type=int, default=0)
    ap.add_argument("--short-steps", type=int, default=0, help="first steps on the short prompt (a curriculum)")
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    params = load_params(args.params)
    path = warm_model_path(params.corpus_path, params.model.tiny, params.model.warm_start)
    model, tok = load_model_and_tokenizer(path, dtype="float32", device="cpu")
    model.train()

    def encode(text: str, user: bool = False) -> list[int]:
        return _encode_user(tok, text) if user else tok.encode(text, add_special_tokens=False)

    names = Names(tok)
    pool, held = teacher_split(read_corpus(params.corpus_path).passages, params.model.warm_start)
    rng = random.Random(0)
    kinds = ["short"] if args.prompt == "short" else ["short", "full"] if args.short_steps else ["full"]
    tests = {kind: grade_examples(held, names, encode, kind == "short", random.Random(1)) for kind in kinds}
    swap = swappable_names(tok)
    swap_set = set(swap)
    found, missing = encode(" found")[0], encode(" missing")[0]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    started = time.perf_counter()

    def update(batch, starts, weights):
        loss = step_loss(model, batch, starts, weights, tok.pad_token_id)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    for step in range(1, args.copy_steps + 1):
        seqs = [rng.sample(swap, 24) for _ in range(32)]
        loss = update([s + s for s in seqs], [24] * len(seqs), {})
        if step % args.every == 0:
            print(f"copy pre-training step {step}: loss {loss:.3f}", flush=True)
    what = ("verdict accuracy", "rubric fact copied", "verdict after its own copy")
    for kind, test in tests.items():
        before = ", ".join(f"{w} {x:.2f}" for w, x in zip(what, held_out(model, test, found, missing), strict=True))
        print(f"{len(test)} held-out grades ({kind} prompt); before training: {before}", flush=True)
    columns = [f"{w} ({kind} prompt)" for kind in tests for w in what]
    print("| step | prompt | loss | " + " | ".join(columns) + " | s |\n|" + "---|" * (len(columns) + 4))
    for step in range(1, args.steps + 1):
        batch, starts = [], []
        short = args.prompt == "short" or step <= args.short_steps
        for prompt, reply, _ in grade_examples(rng.sample(pool, 2 * args.batch), names, encode, short,
                                               rng)[:args.batch]:
            ids = prompt + reply
            present = sorted({t for t in ids if t in swap_set})
            mapping = dict(zip(present, rng.sample(swap, len(present)), strict=True))
            batch.append([mapping.get(t, t) for t in ids])
            starts.append(len(prompt))
        loss = update(batch, starts, {found: args.verdict_weight, missing: args.verdict_weight})
        if step % args.every == 0:
            cells = [f"{x:.2f}" for test in tests.values() for x in held_out(model, test, found, missing)]
            print(f"| {step} | {'short' if short else 'full'} | {loss:.3f} | " + " | ".join(cells) +
                  f" | {time.perf_counter() - started:.0f} |", flush=True)


if __name__ == "__main__":
    main()
