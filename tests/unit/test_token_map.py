# SPDX-License-Identifier: Apache-2.0
"""The draft's hot vocabulary (`--speculative-token-map`, FR-Spec): the table files the
server reads and refuses, the head that scores only the table's tokens (against the full
head's logits restricted by hand), and the frequency ranking that makes the tables."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from runtime.configs.token_map import check_token_map, load_token_map
from runtime.engine.tokenizer import load_tokenizer
from runtime.layers.embedding import HotVocabLMHead, ParallelLMHead
from training.hot_vocab import hot_tokens, stream_counts


@pytest.mark.parametrize(
    "write",
    [
        lambda p: torch.save([9, 3, 3, 0], p.with_suffix(".pt")),
        lambda p: torch.save(torch.tensor([9, 3, 0], dtype=torch.int32), p.with_suffix(".pt")),
        lambda p: p.with_suffix(".json").write_text(json.dumps([0, 9, 3])),
    ],
    ids=["pt-list", "pt-tensor", "json"],
)
def test_tables_load_sorted_and_unique(tmp_path, write):
    write(tmp_path / "freq")
    (path,) = [p for p in tmp_path.iterdir()]
    assert load_token_map(path) == (0, 3, 9)


@pytest.mark.parametrize(
    "content,message",
    [
        (torch.tensor([1.0, 2.0]), "1-D integer tensor"),
        (torch.tensor([[1, 2]]), "1-D integer tensor"),
        ([], "holds no token ids"),
        ([3, -1], "negative token id"),
        (["a", "b"], "list of integer token ids"),
        ([True, False], "list of integer token ids"),
        ({"ids": [1]}, "list of integer token ids"),
    ],
)
def test_bad_tables_are_refused_naming_the_flag(tmp_path, content, message):
    path = tmp_path / "freq.pt"
    torch.save(content, path)
    with pytest.raises(ValueError, match=message) as err:
        load_token_map(path)
    assert "--speculative-token-map" in str(err.value)


def test_unreadable_and_missing_tables_are_refused(tmp_path):
    garbage = tmp_path / "freq.pt"
    garbage.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="is not a token table"):
        load_token_map(garbage)
    bad_json = tmp_path / "freq.json"
    bad_json.write_text("[1, 2")
    with pytest.raises(ValueError, match="is not a token table"):
        load_token_map(bad_json)
    with pytest.raises(ValueError, match="does not exist"):
        load_token_map(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="outside the model's vocabulary of 10"):
        check_token_map((1, 10), vocab_size=10)
    check_token_map((1, 9), vocab_size=10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hot_head_scores_the_table_and_floors_the_rest(dtype):
    torch.manual_seed(0)
    vocab, hidden = 50, 16
    head = ParallelLMHead(vocab, hidden, params_dtype=dtype)
    head.weight.data.copy_(torch.randn(vocab, hidden))
    table = [2, 7, 8, 30, 49]
    hot = HotVocabLMHead(head, table)
    x = torch.randn(6, hidden, dtype=dtype)
    full, got = head.compute_logits(x), hot.compute_logits(x)
    cold = torch.ones(vocab, dtype=torch.bool)
    cold[table] = False
    assert got.shape == full.shape
    # the table's rows are the full head's logits (a product of another shape: rounding)
    torch.testing.assert_close(got[:, table], full[:, table])
    assert (got[:, cold] == torch.finfo(dtype).min).all()
    # argmax is the argmax over the table alone (a dense re-statement of the same product)
    restated = torch.nn.functional.linear(x, head.weight[table])
    assert torch.equal(got[:, table], restated)
    assert torch.equal(got.argmax(-1), torch.tensor(table)[restated.argmax(-1)])
    # a grammar mask that allows only cold tokens still picks an allowed one
    allowed = torch.tensor([0, 1, 5])
    masked = torch.full_like(got, float("-inf"))
    masked[:, allowed] = got[:, allowed]
    assert set(masked.argmax(-1).tolist()) <= set(allowed.tolist())
    # the target's head is untouched (the hot head holds copies of its rows)
    assert hot.weight.data_ptr() != head.weight.data_ptr()
    assert torch.equal(head.compute_logits(x), full)


def test_frequency_ranking_against_a_brute_force_count():
    torch.manual_seed(1)
    stream = torch.randint(0, 40, (5000,)) ** 2 % 37  # a skewed distribution with ties
    framing = {0, 1}
    counts = stream_counts(stream, skip=framing)
    brute = Counter(t for t in stream.tolist() if t not in framing)
    assert counts == brute
    table = hot_tokens(counts, 5, eos_ids=[1])
    by_rank = sorted(brute, key=lambda t: (-brute[t], t))
    assert table == sorted([*by_rank[:5], 1])
    cutoff = brute[by_rank[4]]
    assert all(brute[t] <= cutoff for t in brute if t not in table)


def test_make_token_map_ranks_a_corpus_under_the_models_tokenizer(tmp_path):
    """JSONL records (prompt, messages) and a plain-text directory, counted with the
    embedded model's tokenizer: the table is the brute-force top of those counts plus
    `<|eos|>`, in a file the server loads."""
    from runtime.configs.engine_config import default_model_path
    from scripts import make_token_map

    records = [
        {"prompt": "def add(a, b):\n    return a + b\n"},
        {"messages": [{"role": "user", "content": "for i in range(10):\n    print(i)"}]},
    ]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(r) for r in records))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.py").write_text("import os\nimport sys\nprint(os.getcwd())\n")
    out = tmp_path / "freq.pt"
    tokenizer = load_tokenizer(default_model_path(), required=True)
    texts = [
        records[0]["prompt"],
        records[1]["messages"][0]["content"],
        (docs / "a.py").read_text(),
    ]
    brute = Counter(t for text in texts for t in tokenizer.encode(text, add_special_tokens=False))
    ranked = sorted(brute, key=lambda t: (-brute[t], t))[:8]
    make_token_map.main(
        ["--dataset-path", str(corpus), str(docs), "--num-tokens", "8", "-o", str(out)]
    )
    assert load_token_map(out) == tuple(sorted({*ranked, tokenizer.eos_token_id}))
