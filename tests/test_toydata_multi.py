"""The multi-v1 toy task (issue 15): many valid surface forms per problem, disjoint seeded splits, its scorer, and
the shipped ``tiny-multi`` backbone with its model card."""

from __future__ import annotations

import collections
import itertools
import json
import random
import re
from pathlib import Path

import pytest

from tdlm.data.contamination import prompt_hash
from tdlm.evaluation.scoring import score, score_math
from tdlm.tasks import PROMPT_VERSIONS, load_task
from tdlm.tasks.multi import load_split
from tdlm.tasks.toydata import (
    ARITH_TRAIN_DRAWS,
    MULTI_GEN_LENGTH,
    MULTI_TEST_SIZE,
    MULTI_VALIDATION_SIZE,
    MultiProblem,
    MultiStyle,
    held_out_pool,
    multi_split,
    random_style,
    split,
)

ASSET = Path(__file__).resolve().parents[1] / "tdlm" / "assets" / "tiny-multi"
EQ = re.compile(r"^(\d+) ?= ?(\d+) ?([+-]) ?(\d+)$|^(\d+) ?([+-]) ?(\d+) ?= ?(\d+)$")


def _problem(nums, ops) -> MultiProblem:
    acc = nums[0]
    for o, n in zip(ops, nums[1:], strict=True):
        acc = acc + n if o == "+" else acc - n
    return MultiProblem("t/0", "", tuple(nums), tuple(ops), acc, "")


def _check_form(p: MultiProblem, text: str) -> None:
    """``text`` is a correct worked solution of ``p``: three true equations chaining p's steps, then the box."""
    body, _, boxed = text.rpartition("\\boxed{")
    assert boxed == f"{p.answer}}}", text
    body = next(body.removesuffix(lead) for lead in (", so ", " => ", " ") if body.endswith(lead))
    spaced = " = " in body
    if "; " in body or ", " in body:
        parts = body.split("; " if "; " in body else ", ")
    else:
        words = body.split(" ")
        width = 5 if spaced else 1  # "3 + 5 = 8" is five words
        parts = [" ".join(words[i:i + width]) for i in range(0, len(words), width)]
    assert len(parts) == len(p.ops), (text, parts)
    for part, (acc, op, n, new) in zip(parts, p.steps(), strict=True):
        m = EQ.match(part)
        assert m and (" " in part) == spaced, (text, part)
        if m.group(1):
            c, x, o, y = int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4))
        else:
            x, o, y, c = int(m.group(5)), m.group(6), int(m.group(7)), int(m.group(8))
        assert o == op and c == new and sorted((x, y)) == sorted((acc, n)), (text, part)
        assert op == "+" or (x, y) == (acc, n), (text, part)  # a '-' never swaps


@pytest.mark.parametrize("nums,ops,n_styles", [((3, 5, 2, 9), "+-+", 18 * 8 * 4), ((7, 8, 7, 1), "+++", 18 * 8 * 8),
                                               ((9, 1, 2, 3), "---", 18 * 8)])  # fmt: skip
def test_every_surface_form_is_a_correct_solution_with_the_same_box(nums, ops, n_styles):
    p = _problem(nums, ops)
    assert len(p.styles()) == n_styles
    forms = p.surface_forms()
    assert len(forms) == n_styles  # no two styles of these problems print the same string
    for text in forms:
        _check_form(p, text)
        assert len(text) < MULTI_GEN_LENGTH  # room for <|eot|>
    # forms differ in length and in what stands at a given position: the first character alone has 3+ values
    assert len({len(f) for f in forms}) >= 8
    assert len({f[0] for f in forms}) >= (3 if ops[0] == "+" else 2)
    rng = random.Random(0)
    for text in rng.sample(forms, 24):
        s = score_math("multi", text, str(p.answer))
        assert s.correct and s.extracted == str(p.answer), (text, s)


def test_worked_solution_check_accepts_mixed_styles_and_rejects_wrong_steps():
    p = _problem((4, 3, 3, 6), "+-+")  # 4+3=7, 7-3=4, 4+6=10
    assert all(p.is_worked_solution(f) for f in p.surface_forms())
    assert p.is_worked_solution("3+4=7, 4 = 7 - 3 10=6+4, so \\boxed{10}")  # styles mixed: still a worked solution
    assert not p.is_worked_solution("4+4=7, 5=7-3, 6+6=10 \\boxed{10}")  # right box, wrong steps
    assert not p.is_worked_solution("4+3=7 4=3-7 4+6=10 \\boxed{10}")  # a '-' with its operands swapped
    assert not p.is_worked_solution("4+3=7 4+6=10 \\boxed{10}")  # a step missing
    assert not p.is_worked_solution("4+3=7 7-3=4 4+6=10 \\boxed{11}")
    assert not p.is_worked_solution("4+3=7 7-3=4 4+6=10")


def test_longest_form_of_any_chain_fits_the_generation_length():
    longest = 0
    for nums in itertools.product(range(10), repeat=4):
        for ops in itertools.product("+-", repeat=3):
            acc, ok = nums[0], True
            for o, n in zip(ops, nums[1:], strict=True):
                acc = acc + n if o == "+" else acc - n
                ok &= acc >= 0
            if ok:  # length does not depend on operand order or result side: the widest choices of the rest
                p = _problem(nums, ops)
                longest = max(longest, len(p.render(MultiStyle(True, "; ", ", so ", (False,) * 3, (False,) * 3))))
    assert longest == MULTI_GEN_LENGTH - 5  # 51 characters + <|eot|> in 56


def test_random_styles_cover_the_choices_uniformly():
    p = _problem((2, 6, 1, 4), "++-")
    rng = random.Random(1)
    draws = [random_style(p, rng) for _ in range(6000)]
    assert not any(s.swap[2] for s in draws)  # the '-' step never swaps
    for attr in ("spaced", "separator", "leadin"):
        counts = collections.Counter(getattr(s, attr) for s in draws)
        assert len(counts) in (2, 3) and max(counts.values()) / min(counts.values()) < 1.15, (attr, counts)
    for k in range(3):
        assert 0.45 < sum(s.result_first[k] for s in draws) / len(draws) < 0.55
    assert 0.45 < sum(s.swap[0] for s in draws) / len(draws) < 0.55
    texts = collections.Counter(p.render(s) for s in draws)
    assert len(texts) > 0.8 * len(p.surface_forms())  # 6000 draws reach most of the 576 forms
    with pytest.raises(ValueError, match="only '\\+' steps may swap"):
        p.render(MultiStyle(False, " ", " ", (False, False, True), (False,) * 3))


def test_splits_are_deterministic_disjoint_and_held_out_from_both_backbones():
    pool = held_out_pool(0)
    assert len(pool) == len(set(pool)) == 1034
    test, val = multi_split("test", MULTI_TEST_SIZE), multi_split("validation", MULTI_VALIDATION_SIZE)
    assert [p.question for p in test] == [p.question for p in multi_split("test", MULTI_TEST_SIZE)]
    assert [p.solution for p in val] == [p.solution for p in multi_split("validation", MULTI_VALIDATION_SIZE)]
    tq, vq = {p.question for p in test}, {p.question for p in val}
    assert len(tq) == MULTI_TEST_SIZE and len(vq) == MULTI_VALIDATION_SIZE and not tq & vq
    train, prompts = multi_split("train", 20_000), multi_split("prompts", 2_000)
    assert not ({p.question for p in train} | {p.question for p in prompts}) & (tq | vq)
    # tiny-arith (the init of tiny-multi) never trained on a validation or test chain
    arith_seen = {p.question.replace("=?", " = ?") for p in split("train", ARITH_TRAIN_DRAWS)}
    assert not arith_seen & (tq | vq)
    # the prompts differ from every arith-v1 prompt by hash, so the contamination checks never mix the tasks
    arith_hashes = {prompt_hash(p.question) for p in split("test", 500)} | {prompt_hash(p.question)
                                                                            for p in split("prompts", 600)}
    assert not arith_hashes & {prompt_hash(q) for q in tq | vq | {p.question for p in prompts}}
    for p in test[:50] + val[:50] + train[:50]:
        _check_form(p, p.solution)
        assert p.question == f"{p.nums[0]}{p.ops[0]}{p.nums[1]}{p.ops[1]}{p.nums[2]}{p.ops[2]}{p.nums[3]} = ?"
    with pytest.raises(ValueError, match="at most 534"):
        multi_split("validation", 535)
    with pytest.raises(ValueError, match="unknown split"):
        multi_split("dev", 1)


def test_registered_task_is_the_test_split_and_scores_by_the_box():
    task = load_task("multi")
    assert len(task) == MULTI_TEST_SIZE and task.prompt_version == PROMPT_VERSIONS["multi"] == "multi-v1"
    assert task[0].id == "multi/000000" and task[0].task == "multi" and task.source.startswith("generated:")
    val = load_split("validation", limit=20)
    assert len(val) == 20 and val[0].id == "multi-validation/000000" and "split=validation" in val.source
    assert not {p.prompt for p in val} & {p.prompt for p in task}
    p = val[0]
    prob = MultiProblem(p.id, p.prompt, tuple(p.raw["nums"]), tuple(p.raw["ops"]), int(p.answer), "")
    forms = prob.surface_forms()
    for text in (forms[0], forms[-1], p.raw["solution"]):
        assert score(p, text).correct
    wrong = str(int(p.answer) + 1)
    assert not score(p, forms[0].replace(f"\\boxed{{{p.answer}}}", f"\\boxed{{{wrong}}}")).correct
    # the box is what counts: a garbled response ending with the right number but no box is wrong ...
    garbled = forms[0].replace("\\boxed{", "\\oxed{")
    assert score(p, garbled).status == "unparsed"
    # ... (arith's scorer falls back to the last number and accepts it), and a garbled body with the right box is right
    assert score_math("arith", garbled, p.answer).correct
    assert score(p, "1==+ 3 ,, \\boxed{" + p.answer + "}").correct


@pytest.fixture(scope="module")
def card():
    if not (ASSET / "config.json").exists():
        pytest.fail(f"{ASSET} is missing: train it with scripts/train_tiny_backbone.py --task multi")
    return json.loads((ASSET / "training.json").read_text()), (ASSET / "README.md").read_text()


def test_shipped_tiny_multi_loads_and_its_card_matches_training_json(card):
    import torch

    import tdlm
    from tdlm.data.tokenizer import load_tokenizer

    meta, readme = card
    bb = tdlm.load_backbone("tiny-multi", dtype=torch.float32)
    assert bb.backbone_id == "tiny-multi" and bb.family == "llada"
    assert bb.num_parameters() == meta["parameters"]
    weights = sum(f.stat().st_size for f in ASSET.glob("*.safetensors"))
    assert weights == meta["weights_bytes"] < 4 * 2**20  # bf16, a few MB
    assert json.loads((ASSET / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert meta["task"] == "multi-v1" and meta["gen_length"] == MULTI_GEN_LENGTH
    assert meta["eval_split"] == "validation" and meta["validation_size"] == MULTI_VALIDATION_SIZE
    assert meta["init"]["backbone"] == "tiny-arith"
    assert load_tokenizer("tiny-multi").convert_tokens_to_ids("<|mask|>") == bb.mask_token_id
    # every number of the card is the one in training.json
    assert f"{meta['parameters']:,} parameters" in readme
    assert f"seed {meta['seed']}, {meta['steps']} steps of\n{meta['batch_size']} problems" in readme
    assert f"{meta['minutes']} minutes of training" in readme and f"({meta['weights_bytes']:,} bytes)" in readme
    acc = meta["validation_accuracy_original"]
    assert f"| {MULTI_GEN_LENGTH} | {100 * acc[f'block{MULTI_GEN_LENGTH}']:.1f}% |" in readme
    assert f"| 8 | {100 * acc['block8']:.1f}% |" in readme
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| (\d+)% \| ([\d.]+) \|$", readme, re.M)
    n = meta["curve_problems"]
    assert [(int(s), float(lo), int(a), float(m)) for s, lo, a, m in rows] == [
        (c["step"], c["loss_ema"], round(100 * c[f"acc@{n}"]), c["minutes"]) for c in meta["curve"]]
    assert meta["curve"][-1]["step"] == meta["steps"]


def test_shipped_tiny_multi_solves_validation_problems_at_its_card_accuracy(card):
    """`original` decoding of the shipped weights on the first 60 validation problems is near the card's accuracy over
    all 300 (the whole split takes ~75 s on one core; the validation bench below reproduced it exactly)."""
    import torch

    import tdlm
    from tdlm.data.tokenizer import encode_prompts, load_tokenizer, stop_token_ids
    from tdlm.decoding import decode

    meta, _ = card
    bb = tdlm.load_backbone("tiny-multi", dtype=torch.float32)
    tok = load_tokenizer("tiny-multi")
    val = multi_split("validation", 60)
    out = decode(bb, encode_prompts(tok, [p.question for p in val]), policy="original", gen_length=MULTI_GEN_LENGTH,
                 block_size=MULTI_GEN_LENGTH, tokenizer=tok, stop_ids=stop_token_ids(tok, bb.eos_token_id))
    acc = sum(score_math("multi", r.text, str(p.answer)).correct for r, p in zip(out, val, strict=True)) / len(val)
    # binomial sd at p ~ 0.66, n = 60 is 0.061: 0.2 is more than 3 sd
    assert abs(acc - meta["validation_accuracy_original"][f"block{MULTI_GEN_LENGTH}"]) < 0.2


def test_validation_bench_matches_the_shipped_backbone_and_its_card(card):
    """bench/results/multi_backbone_validation.json was measured on exactly the shipped weights, and its `original`
    row (scored by Math-Verify on the box) equals the card's accuracy (scored by the training script)."""
    import tdlm

    meta, _ = card
    bench = json.loads((ASSET.parents[2] / "bench" / "results" / "multi_backbone_validation.json").read_text())
    assert bench["backbone_fingerprint"] == tdlm.load_backbone("tiny-multi").weight_fingerprint
    assert bench["split"] == "multi-v1 validation" and bench["gen_length"] == bench["block_size"] == MULTI_GEN_LENGTH
    rows = {r["method"]: r for r in bench["rows"]}
    orig = rows["original"]
    assert orig["problems"] == meta["validation_size"]
    assert orig["accuracy"] == pytest.approx(meta["validation_accuracy_original"][f"block{MULTI_GEN_LENGTH}"])
    assert orig["nfe_mean"] == MULTI_GEN_LENGTH
    # what the bench was run to show: threshold decoding trades accuracy for evaluations as tau falls
    taus = sorted((r for r in bench["rows"] if r["policy"] == "threshold"), key=lambda r: -r["tau"])
    assert [r["tau"] for r in taus] == [0.9, 0.7, 0.5, 0.3]
    assert all(a["nfe_mean"] > b["nfe_mean"] for a, b in itertools.pairwise(taus))
    assert all(a["accuracy"] > b["accuracy"] for a, b in itertools.pairwise(taus))
