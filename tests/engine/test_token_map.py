# SPDX-License-Identifier: Apache-2.0
"""`--speculative-token-map` (FR-Spec's hot vocabulary, SGLang's flag): the draft's LM head
scores only the table's tokens; by default (`auto`) the table a checkpoint names in its
config.json, `none` the whole vocabulary.

Whatever the table holds, the output is plain decoding's (greedy for both families, and with
grammars whose tokens are all outside the table; sampling keeps plain sampling's
distribution: `test_nextn_exactness.py`); the
draft proposes only table tokens; and with a table holding every token the whole-vocabulary
draft proposed, it proposes exactly what that draft did.
"""

from __future__ import annotations

import json

import pytest

from runtime import Engine
from tests.engine.test_nextn import make_prompts
from tests.engine.test_speculation_off_by_batch_size import engine_of

NUM_PROMPTS = 6
GREEDY = [
    {"temperature": 0, "max_new_tokens": 12 + 7 * i, "ignore_eos": True} for i in range(NUM_PROMPTS)
]


def nextn_of(path, table=None, **kw) -> Engine:
    return engine_of(
        path,
        speculative_algorithm="NEXTN",
        speculative_num_steps=3,
        speculative_token_map=table,
        **kw,
    )


def write_table(tmp_path, ids, name="freq.json"):
    path = tmp_path / name
    path.write_text(json.dumps(sorted(ids)))
    return str(path)


def proposals_of(engine) -> list[list[int]]:
    """Every proposal the drafter makes, in order."""
    seen = []
    drafter = engine.worker.drafter
    draft = drafter.draft

    def recording(batch):
        out = draft(batch)
        seen.extend(d for d in out if d is not None)
        return out

    drafter.draft = recording
    return seen


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Plain greedy output and the whole-vocabulary draft's proposals."""
    prompts = make_prompts(NUM_PROMPTS, seed=3)
    plain = engine_of(checkpoint).generate(input_ids=prompts, sampling_params=GREEDY)
    nextn = nextn_of(checkpoint)
    proposals = proposals_of(nextn)
    outs = nextn.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    return prompts, [o["output_ids"] for o in plain], proposals, nextn.worker.stats


def test_a_table_of_every_proposed_token_proposes_the_same(checkpoint, reference, tmp_path):
    """The table's argmax is the whole vocabulary's argmax whenever that falls in the table."""
    prompts, plain, proposals, stats = reference
    proposed = {t for p in proposals for t in p}
    nextn = nextn_of(checkpoint, write_table(tmp_path, proposed))
    hot = proposals_of(nextn)
    outs = nextn.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain
    assert hot == proposals
    assert nextn.worker.stats.accepted_at == stats.accepted_at


@pytest.mark.parametrize("share", ["half", "accepted-removed", "one-token"])
def test_any_table_keeps_the_output_plain(checkpoint, reference, tmp_path, share):
    """Tables that leave out tokens the target wants: the draft proposes only table tokens,
    the rejected ones cost acceptance, never a changed token."""
    prompts, plain, proposals, _ = reference
    vocab = nextn_of(checkpoint).model_config.vocab_size
    wanted = {t for out in plain for t in out}
    table = {
        "half": set(range(0, vocab, 2)),
        "accepted-removed": set(range(vocab)) - set(sorted(wanted)[::2]),
        "one-token": {vocab - 1},
    }[share]
    nextn = nextn_of(checkpoint, write_table(tmp_path, table))
    hot = proposals_of(nextn)
    outs = nextn.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain
    assert hot and {t for p in hot for t in p} <= table
    assert nextn.worker.stats.verify_rounds > 0


def test_grammars_over_tokens_outside_the_table_keep_plain_output(tmp_path):
    """On the embedded model with its shipped table minus every digit token: a regex of
    digits only, a JSON schema and an EBNF. The grammar walk picks among the allowed cold
    tokens (never a forbidden one), and the output is plain decoding's."""
    from runtime.configs.engine_config import default_model_path
    from runtime.configs.token_map import load_token_map
    from tests.server.test_clients import EBNF, SCHEMA

    common = dict(dtype="float32", constrained_json_disable_any_whitespace=True)
    plain_engine = Engine(**common)
    tokenizer = plain_engine.tokenizer
    shipped = load_token_map(f"{default_model_path()}/freq_2048.json")
    digits = {t for t in shipped if any(c.isdigit() for c in tokenizer.decode([t]))}
    assert digits
    table = write_table(tmp_path, set(shipped) - digits)
    prompts = ["x = ", "class Foo:\n    def __init__(self):\n        ", "settings = "]
    grammars = [{"regex": r"[0-9]{12}"}, {"ebnf": EBNF}, {"json_schema": json.dumps(SCHEMA)}]
    params = [{"temperature": 0, "max_new_tokens": n, **g} for n, g in zip((12, 24, 40), grammars)]
    plain = plain_engine.generate(prompts, params)
    nextn = Engine(**common, speculative_algorithm="NEXTN", speculative_token_map=table)
    outs = nextn.generate(prompts, params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in plain]
    assert all(c.isdigit() for c in outs[0]["text"]) and outs[0]["text"]


def test_a_table_past_the_vocabulary_fails_before_loading_weights(checkpoint, tmp_path):
    table = write_table(tmp_path, [1, 5, 100_000])
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        nextn_of(checkpoint, table)


def test_server_info_reports_the_table(checkpoint, tmp_path):
    table = write_table(tmp_path, range(40))
    info = nextn_of(checkpoint, table).info.to_json()
    assert info["speculative_token_map"] == table
    assert engine_of(checkpoint).info.to_json()["speculative_token_map"] is None


# the checkpoint's own table (`--speculative-token-map auto`, the default) ---------------------


def with_own_table(checkpoint, tmp_path, ids, name="freq_own.json"):
    """A copy of `checkpoint` whose config.json names a table of `ids` shipped beside it."""
    import shutil

    from runtime.configs.token_map import CHECKPOINT_KEY

    copy = tmp_path / "with_table"
    shutil.copytree(checkpoint, copy)
    write_table(copy, ids, name)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, CHECKPOINT_KEY: name}))
    return copy


def test_the_checkpoints_own_table_is_the_default(checkpoint, reference, tmp_path):
    """A checkpoint that names its table drafts over it unless `none` is asked for: `auto`
    and unset resolve to it (the info reports it), `none` to the whole vocabulary; output
    plain either way."""
    prompts, plain, proposals, _ = reference
    table = set(range(0, nextn_of(checkpoint).model_config.vocab_size, 3))
    own = with_own_table(checkpoint, tmp_path, table)
    for value in (None, "auto", "AUTO"):
        nextn = nextn_of(own, value)
        assert nextn.info.to_json()["speculative_token_map"] == str(own / "freq_own.json")
        hot = proposals_of(nextn)
        outs = nextn.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == plain
        assert hot and {t for p in hot for t in p} <= table
    whole = nextn_of(own, "none")
    assert whole.info.to_json()["speculative_token_map"] is None
    seen = proposals_of(whole)
    outs = whole.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == plain
    assert seen == proposals  # the whole vocabulary's draft, as without a table
    assert nextn_of(checkpoint, "auto").info.to_json()["speculative_token_map"] is None


def test_a_missing_own_table_names_the_config_key(checkpoint, tmp_path):
    own = with_own_table(checkpoint, tmp_path, range(10))
    (own / "freq_own.json").unlink()
    with pytest.raises(ValueError, match="speculative_token_map"):
        nextn_of(own)
    assert nextn_of(own, "none").info.to_json()["speculative_token_map"] is None


def test_the_embedded_model_names_its_shipped_table():
    """Config resolution only (no weights): the default model drafts over its shipped
    table; `auto` and `none` need no algorithm, a file does."""
    from runtime.configs.engine_config import EngineConfig, default_model_path

    shipped = f"{default_model_path()}/freq_2048.json"
    spec = EngineConfig(speculative_algorithm="NEXTN").resolve().speculative_config()
    assert spec.token_map == shipped and len(spec.hot_token_ids) == 2049
    off = EngineConfig(speculative_algorithm="NEXTN", speculative_token_map="none").resolve()
    assert off.speculative_config().token_map is None
    for value in ("auto", "none", None):
        assert EngineConfig(speculative_token_map=value).resolve().speculative_config() is None
    with pytest.raises(ValueError, match="need --speculative-algorithm"):
        EngineConfig(speculative_token_map=shipped).resolve()
