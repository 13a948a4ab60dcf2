"""Passkey retrieval: prompt construction, scoring, and one run on a tiny random model."""

from __future__ import annotations

import math
import random

import pytest

from kvbits.eval.needle import (
    NeedleConfig,
    build_passkey_prompt,
    haystack_ids,
    needle_markdown,
    paired_against,
    passkey_correct,
    run_needle,
    summarize,
    write_needle,
)


class CharTokenizer:
    """One token per byte; enough for prompt construction (no chat template)."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False, verbose=False):
        return {"input_ids": list(text.encode("utf-8", "replace"))}

    def decode(self, ids, skip_special_tokens=True):
        return bytes(int(i) % 256 for i in ids).decode("utf-8", "replace")


TEXT = " ".join(f"Sentence number {i} is about the state of the union." for i in range(400))


def test_passkey_scoring():
    assert passkey_correct(" 71432.", "71432")
    assert passkey_correct("The pass key is 71432, remember", 71432)
    assert not passkey_correct(" 7143", 71432)
    assert not passkey_correct(" 714321", 71432)
    assert not passkey_correct(" 12345 71432", 71432)  # the first number counts
    assert not passkey_correct("no digits", 71432)


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_prompt_has_the_length_and_the_needle_at_a_sentence_boundary(depth):
    tok = CharTokenizer()
    hay, ends = haystack_ids(tok, TEXT)
    p = build_passkey_prompt(tok, hay, ends, 1500, depth, 71432, offset=333, chat=False)
    assert len(p.ids) == 1500
    text = tok.decode(p.ids)
    assert "The pass key is 71432. Remember it. 71432 is the pass key." in text
    assert text.endswith("What is the pass key? The pass key is")
    assert tok.decode(p.ids[-p.question_tokens:]).startswith("\n\nWhat is the pass key?")
    before = tok.decode(p.ids[:p.needle_at])
    needle_len = len(tok("\n\nThe pass key is 71432. Remember it. 71432 is the pass key.\n\n")
                     ["input_ids"])
    if depth == 0.0:
        assert before.endswith("I will quiz you about the pass key.\n\n")
    elif depth == 1.0:  # right before the question
        assert p.needle_at + needle_len == len(p.ids) - p.question_tokens
    else:
        assert before.rstrip().endswith(".")  # a sentence of the haystack ended there
        head = len(tok("There is an important pass key hidden inside a lot of irrelevant text. "
                       "Find it and memorize it. I will quiz you about the pass key.\n\n")
                   ["input_ids"])
        n_hay = len(p.ids) - head - p.question_tokens - needle_len
        assert abs((p.needle_at - head) / n_hay - depth) < 0.05


def test_prompt_too_short_is_an_error():
    tok = CharTokenizer()
    hay, ends = haystack_ids(tok, TEXT)
    with pytest.raises(ValueError, match="too short"):
        build_passkey_prompt(tok, hay, ends, 100, 0.5, 12345, chat=False)


@pytest.mark.parametrize("depth", [0.25, 0.5, 0.75])
def test_a_text_without_sentence_ends_still_puts_the_needle_at_its_depth(depth):
    """With no . ? ! in the haystack every needle below 100% went to depth 0."""
    tok = CharTokenizer()
    flat = " ".join(f"word{i} and more words" for i in range(600))
    hay, ends = haystack_ids(tok, flat)
    assert ends == [0]
    p = build_passkey_prompt(tok, hay, ends, 1500, depth, 71432, chat=False)
    head = len(tok("There is an important pass key hidden inside a lot of irrelevant text. "
                   "Find it and memorize it. I will quiz you about the pass key.\n\n")
               ["input_ids"])
    needle_len = len(tok("\n\nThe pass key is 71432. Remember it. 71432 is the pass key.\n\n")
                     ["input_ids"])
    n_hay = len(p.ids) - head - p.question_tokens - needle_len
    assert abs((p.needle_at - head) / n_hay - depth) < 0.01


@pytest.mark.parametrize("lengths,text,error", [
    # a text too short for the longest length: found only at its first trial, after every
    # shorter length's trials had run
    ((300, 1200), "x" * 900, (r"haystack text has 900 tokens; a 1200-token prompt needs "
                              r".*longer text or shorter lengths")),
    # `kvbits needle --lengths 1k,50` ran every 1k trial, then failed at the first of 50
    ((300, 50), None, (r"length 50 is too short for the instruction, needle and question "
                       r"\(\d+ tokens\): give lengths \(--lengths\)")),
])
def test_a_length_that_cannot_be_built_fails_before_any_trial(lengths, text, error):
    from kvbits.eval.speed import build_model, model_config

    model = build_model(model_config("tiny"), device="cpu")
    cfg = NeedleConfig(lengths=lengths, depths=(0.5,), presets=("fp16",), trials=1,
                       max_new_tokens=1, chat=False)
    logged = []
    with pytest.raises(ValueError, match=error):
        run_needle(model, CharTokenizer(), TEXT if text is None else text, cfg,
                   log=logged.append)
    assert logged == []


def test_lengths_a_preset_keeps_in_fp16_are_announced():
    """Below S + R + G tokens (kivi-2: 160) a preset quantizes nothing and answered as FP16,
    silently."""
    from kvbits.eval.speed import build_model, model_config

    model = build_model(model_config("tiny"), device="cpu")
    cfg = NeedleConfig(lengths=(280,), depths=(0.5,), presets=("fp16", "kivi-2:R=256"),
                       trials=1, max_new_tokens=1, chat=False)
    with pytest.warns(UserWarning, match=r"kivi-2:R=256 keeps up to 288 tokens in FP16"):
        run_needle(model, CharTokenizer(), TEXT, cfg, log=lambda m: None)


def test_run_needle_on_a_tiny_random_model(tmp_path):
    from kvbits.eval.speed import build_model, model_config

    model = build_model(model_config("tiny"), device="cpu")
    cfg = NeedleConfig(lengths=(400,), depths=(0.0, 1.0), presets=("fp16", "kivi-2"), trials=2,
                       max_new_tokens=3, chat=False)
    rows = run_needle(model, CharTokenizer(), TEXT, cfg, log=lambda m: None)
    assert len(rows) == 2 * 2 * 2
    assert [r["preset"] for r in rows[:2]] == ["fp16", "kivi-2"]  # rows keep the config's order
    assert {r["trial"] for r in rows} == {0, 1}
    # same trial, same key and document for every preset
    assert len({(r["key"], r["needle_at"]) for r in rows if r["trial"] == 0
                and r["depth"] == 0.0}) == 1
    s = summarize(rows)
    assert set(s) == {"fp16", "kivi-2"} and 0.0 <= s["kivi-2"]["acc"] <= 1.0
    meta = {"model": "tiny", "text": "synthetic", "command": "test"}
    paths = write_needle(tmp_path, rows, meta)
    assert all(p.exists() for p in paths)
    assert "## kivi-2" in needle_markdown(rows, meta)


def test_run_needle_presets_with_overrides_and_kv_bits():
    from kvbits.eval.speed import build_model, model_config

    model = build_model(model_config("tiny"), device="cpu")
    cfg = NeedleConfig(lengths=(400,), depths=(0.5,), presets=("fp16", "kivi-2:S=1,R=64"),
                       trials=1, max_new_tokens=2, chat=False)
    rows = run_needle(model, CharTokenizer(), TEXT, cfg, log=lambda m: None)
    assert [r["preset"] for r in rows] == ["fp16", "kivi-2:S=1,R=64"]
    assert rows[1]["spec"] == "kivi K2V2 G=32 R=64 S=1"
    assert rows[0]["kv_bits"] == 16.0 and 2.0 < rows[1]["kv_bits"] < 16.0
    assert "## Effective KV bits" in needle_markdown(rows, {})


def test_lengths_past_the_trained_positions_are_announced():
    """`needle --lengths 9000` on SmolLM2 (8192 positions) ran silently and missed the key."""
    from kvbits.eval.speed import build_model, model_config

    model = build_model(model_config("tiny", max_positions=512), device="cpu")
    model.config.max_position_embeddings = 300
    cfg = NeedleConfig(lengths=(400,), depths=(0.5,), presets=("fp16",), trials=1,
                       max_new_tokens=1, chat=False)
    with pytest.warns(UserWarning, match="length 400 is past the 300 positions"):
        run_needle(model, CharTokenizer(), TEXT, cfg, log=lambda m: None)


def test_summary_accuracy_per_cell():
    rows = [{"preset": "a", "length": 1, "depth": 0.0, "correct": c, "trial": i}
            for i, c in enumerate([True, False, True, True])]
    assert summarize(rows)["a"] == {"acc": 0.75, (1, 0.0): 0.75}


def _pairs(base: list[bool], other: list[bool]) -> list[dict]:
    rows = []
    for preset, results in (("fp16", base), ("q", other)):
        rows += [{"preset": preset, "length": 1024, "depth": 0.5, "trial": i, "correct": c,
                  "spec": preset, "key": "1", "answer": ""} for i, c in enumerate(results)]
    return rows


def test_paired_against_counts_discordant_trials_and_the_exact_mcnemar_p():
    # 3 lost, 0 won: p = 2 * (1/2)^3
    n, lost, won, p = paired_against(_pairs([True] * 5, [False, False, False, True, True]))["q"]
    assert (n, lost, won) == (5, 3, 0) and p == pytest.approx(0.25)
    # equal losses and wins, or no discordant pair at all: no evidence of a gap
    assert paired_against(_pairs([True, False], [False, True]))["q"][3] == 1.0
    assert paired_against(_pairs([True, False], [True, False]))["q"] == (2, 0, 0, 1.0)
    # a trial the baseline did not run is not paired
    rows = _pairs([True], [False]) + [{"preset": "q", "length": 2048, "depth": 0.5, "trial": 0,
                                        "correct": False}]
    assert paired_against(rows)["q"][:3] == (1, 1, 0)


@pytest.mark.parametrize("seed", range(5))
def test_paired_p_equals_the_two_sided_binomial_test(seed):
    """Against the textbook definition: the total probability, under Binomial(d, 1/2), of every
    split of the d discordant pairs no more likely than the one observed."""
    g = random.Random(seed)
    base = [g.random() < 0.7 for _ in range(40)]
    other = [b if g.random() < 0.6 else not b for b in base]
    _, lost, won, p = paired_against(_pairs(base, other))["q"]
    d = lost + won
    prob = [math.comb(d, i) / 2 ** d for i in range(d + 1)]
    assert p == pytest.approx(sum(x for x in prob if x <= prob[lost] * (1 + 1e-12)))
    assert "## Paired against fp16" in needle_markdown(_pairs(base, other), {})


def _scripted(model, script: list[int]):
    """Make ``model``'s greedy answer follow ``script``: a forward of several tokens (the
    document, the question) puts the argmax of its last logit on ``script[0]``, each one-token
    forward after it on the next token of the script."""
    state = {"i": 0}

    def hook(module, args, kwargs, out):
        ids = kwargs.get("input_ids", args[0] if args else None)
        state["i"] = 0 if ids.shape[1] > 1 else state["i"] + 1
        out.logits[:, -1] = -1e4
        out.logits[:, -1, script[min(state["i"], len(script) - 1)]] = 1e4
        return out

    return model.register_forward_hook(hook, with_kwargs=True)


def test_the_answer_ends_at_the_end_of_turn_token():
    """A model that answers without the key and ends its turn misses, whatever it would emit
    after its end-of-turn token. SmolLM2's greedy answer went on past <|im_end|> into a made-up
    next turn (' 60494.<|im_end|>\\n<|im_end|><|im_start|>system...'), which decode() with
    skip_special_tokens glued onto the answer, so a key in that tail scored as retrieved."""
    from kvbits.eval.speed import build_model, model_config

    model = build_model(model_config("tiny"), device="cpu")
    eos = 3
    model.generation_config.eos_token_id = eos
    cfg = NeedleConfig(lengths=(400,), depths=(0.5,), presets=("fp16", "kivi-2"), trials=1,
                       max_new_tokens=12, chat=False)
    key = str(random.Random(cfg.seed).randint(10000, 99999))  # the run's first (only) draw
    handle = _scripted(model, [*b" no.", eos, *key.encode(), *b"."])
    try:
        rows = run_needle(model, CharTokenizer(), TEXT, cfg, log=lambda m: None)
    finally:
        handle.remove()
    assert [r["key"] for r in rows] == [key, key]
    assert [(r["answer"], r["correct"]) for r in rows] == [(" no.", False)] * 2


def test_an_answer_without_end_of_turn_keeps_every_new_token():
    from kvbits.eval.speed import build_model, model_config

    model = build_model(model_config("tiny"), device="cpu")  # eos_token_id None
    cfg = NeedleConfig(lengths=(400,), depths=(0.5,), presets=("fp16",), trials=1,
                       max_new_tokens=7, chat=False)
    key = str(random.Random(cfg.seed).randint(10000, 99999))
    handle = _scripted(model, [*b" ", *key.encode(), *b". x"])
    try:
        rows = run_needle(model, CharTokenizer(), TEXT, cfg, log=lambda m: None)
    finally:
        handle.remove()
    assert rows[0]["answer"] == f" {key}." and rows[0]["correct"]


@pytest.mark.parametrize("depth", [1.5, -0.1, 50, math.nan])
def test_a_depth_outside_0_1_is_refused(depth):
    """A depth past 1 (a percentage, say) went right before the question and one below 0 right
    after the instruction, silently; NaN put the needle at the nearest sentence end to 0."""
    tok = CharTokenizer()
    hay, ends = haystack_ids(tok, TEXT)
    with pytest.raises(ValueError, match=r"depth must be a fraction in \[0, 1\]"):
        build_passkey_prompt(tok, hay, ends, 1500, depth, 71432, chat=False)


@pytest.mark.parametrize("field,value,error", [
    ("depths", (0, 25, 50), r"NeedleConfig.depths: fractions in \[0, 1\] .*got 25"),
    ("depths", (), r"NeedleConfig.depths: give at least one"),
    ("depths", (0.5, 0.5), r"NeedleConfig.depths: 0.5 given twice"),
    ("lengths", (), r"NeedleConfig.lengths: give at least one"),
    ("lengths", (1024, 0), r"NeedleConfig.lengths: token counts >= 1, got 0"),
    ("lengths", (1024, 1024), r"NeedleConfig.lengths: 1024 given twice"),
    ("lengths", (1024.5,), r"NeedleConfig.lengths: token counts >= 1, got 1024.5"),
    ("trials", 0, r"NeedleConfig.trials must be an integer >= 1, got 0"),
    ("max_new_tokens", 0, r"NeedleConfig.max_new_tokens must be an integer >= 1, got 0"),
])
def test_run_needle_refuses_a_config_it_cannot_serve(field, value, error):
    """These ran silently before: depths given in percent all went right before the question,
    a repeated length or depth counted its trials twice, trials=0 wrote an empty table and
    max_new_tokens=0 scored every preset 0%; an empty lengths tuple failed in max()."""
    cfg = NeedleConfig(lengths=(300,), depths=(0.5,), presets=("fp16",), trials=1,
                       max_new_tokens=1, chat=False)
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=error):
        run_needle(None, CharTokenizer(), TEXT, cfg, log=lambda m: None)  # before the model


class BosCharTokenizer(CharTokenizer):
    """A CharTokenizer that, like Gemma's, puts a BOS first when asked for special tokens."""

    bos_token_id = 300

    def __call__(self, text, add_special_tokens=False, verbose=False):
        ids = super().__call__(text)["input_ids"]
        return {"input_ids": ([self.bos_token_id] if add_special_tokens else []) + ids}


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_the_plain_prompt_starts_with_the_bos_the_tokenizer_adds(depth):
    # a base model without a chat template (gemma3-270m) got no BOS at all: every piece was
    # tokenized without special tokens, unlike ppl's text (kvbits.data.tokenize_text)
    tok = BosCharTokenizer()
    hay, ends = haystack_ids(tok, TEXT)
    p = build_passkey_prompt(tok, hay, ends, 1500, depth, 71432, offset=333, chat=False)
    assert p.ids[0] == tok.bos_token_id and p.ids.count(tok.bos_token_id) == 1
    assert len(p.ids) == 1500
    assert tok.decode(p.ids[p.needle_at:]).startswith("\n\nThe pass key is 71432.")
    # no BOS where the tokenizer adds none (SmolLM2, Qwen)
    q = build_passkey_prompt(CharTokenizer(), hay, ends, 1500, depth, 71432, offset=333,
                             chat=False)
    assert q.ids[0] != tok.bos_token_id and len(q.ids) == 1500


def test_fractional_depths_keep_their_own_labels():
    # --depths 12.5,13 printed both rows as "12%" / "13%" ('.0f' rounds 12.5 to 12): the table
    # named a depth the needle was not at
    rows = [{"length": 1024, "depth": d, "trial": 0, "preset": "fp16", "spec": "fp16",
             "key": "71432", "answer": " 1.", "correct": False} for d in (0.125, 0.13)]
    md = needle_markdown(rows, {"model": "m", "text": "t"})
    assert "| 12.5% |" in md and "| 13%   |" in md
    assert "| 12%" not in md


def test_two_fp16_presets_each_answer_from_the_document_alone(tmp_path):
    """Every unquantized preset read the one prefill DynamicCache itself: the first appended its
    question and answer to it, so a second one (an fp16 spec file beside fp16) answered from the
    document + the first preset's question and answer, at shifted positions."""
    import torch

    from kvbits.eval.speed import build_model, model_config
    from kvbits.spec import resolve_spec

    path = tmp_path / "plain.json"
    resolve_spec("fp16").save(path)
    model = build_model(model_config("tiny"), device="cpu")
    seen = []  # the cache length each multi-token forward (document, question) starts from

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if ids.shape[1] > 1:
            seen.append(cache.get_seq_length())

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    cfg = NeedleConfig(lengths=(400,), depths=(0.5,), presets=("fp16", str(path), "kivi-2"),
                       trials=1, max_new_tokens=4, chat=False)
    try:
        with torch.no_grad():
            rows = run_needle(model, CharTokenizer(), TEXT, cfg, log=lambda m: None)
    finally:
        handle.remove()
    doc = 400 - len(CharTokenizer()("\n\nWhat is the pass key? The pass key is")["input_ids"])
    assert seen == [0, doc, doc, doc]  # the prefill, then each preset's question
    assert rows[0]["answer"] == rows[1]["answer"]  # the same cache contents: the same answer
