# SPDX-License-Identifier: Apache-2.0
"""The tiny-model trainer (`python -m training.train_tiny_model`), run for a few steps with
a tiny shape on a slice of the stdlib, for each family (DeepSeek-V4, Qwen4Exp): its
checkpoint has the released key set, the runtime serves it (plain and NEXTN), transformers
loads it, and the MTP it trains is exactly the runtime's draft."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from runtime import Engine
from runtime.engine.tokenizer import load_tokenizer
from tests.runners import load_runner
from training import train_tiny_model
from training.corpus import TOKEN_IDS
from training.evaluation import transformers_parity
from training.export import load_checkpoint
from training.families import qwen4_exp

TINY_SHAPE = {
    "corpus-limit-files": 24, "vocab-size": 384, "hidden-size": 64, "num-layers": 3,
    "num-heads": 2, "head-dim": 32, "rope-dim": 16, "q-lora-rank": 32, "o-groups": 2,
    "o-lora-rank": 16, "sliding-window": 16, "hca-rate": 8, "index-heads": 8,
    "index-head-dim": 16, "index-topk": 3, "num-experts": 4, "moe-intermediate-size": 32,
    "num-hash-layers": 1, "max-positions": 512, "seq-len": 64, "batch-size": 2,
    "warmup-steps": 2, "max-steps": 3, "max-minutes": 0, "seed": 3, "eval-windows": 4,
}  # fmt: skip
QWEN_TINY_SHAPE = {
    "family": "qwen4_exp", "corpus-limit-files": 24, "vocab-size": 384, "hidden-size": 64,
    "num-layers": 4, "num-heads": 4, "num-kv-heads": 2, "head-dim": 32, "linear-head-dim": 16,
    "index-heads": 4, "index-head-dim": 16, "index-budget": 16, "num-experts": 4,
    "moe-intermediate-size": 32, "shared-expert-intermediate-size": 32, "hc-lowrank": 8,
    "ple-embed-dim": 64, "ngram-vocab-base": 512, "max-positions": 512, "seq-len": 64,
    "batch-size": 2, "warmup-steps": 2, "max-steps": 3, "max-minutes": 0, "seed": 3,
    "eval-windows": 4,
}  # fmt: skip
GREEDY = {"temperature": 0, "max_new_tokens": 12}
PROMPT = "import os\n\n\ndef main(argv):\n"


def train_tiny(root: Path, shape: dict) -> Path:
    out = root / "model"
    # one torch thread: main() sets the count for the whole test process (shared 2 cores)
    flags = {**shape, "output-dir": out, "work-dir": root / "work", "threads": 1}
    train_tiny_model.main([*(f"--{k}={v}" for k, v in flags.items()), "--skip-runtime-eval"])
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("tiny_train"), TINY_SHAPE)


@pytest.fixture(scope="module")
def qwen_trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("tiny_train_qwen"), QWEN_TINY_SHAPE)


@pytest.fixture(params=["trained", "qwen_trained"])
def any_trained(request):
    """The checkpoint of each family, for what every family must do alike."""
    return request.getfixturevalue(request.param)


def test_checkpoint_directory(trained):
    names = {p.name for p in trained.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "training.json",
        "evaluation.json",
    } <= names
    config = json.loads((trained / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["torch_dtype"] == "bfloat16"
    assert set(config["layer_types"]) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    summary = json.loads((trained / "training.json").read_text())
    assert summary["steps"] == 3 and summary["heldout"]["trunk"] > 0
    assert "Held-out results" in (trained / "README.md").read_text()
    # the draft's hot vocabulary: loadable by the server, ending replies is always proposable
    # and named by the config, so the server's default (`auto`) drafts over it
    from runtime.configs.token_map import check_token_map, checkpoint_token_map, load_token_map

    table = load_token_map(trained / "freq_2048.json")
    check_token_map(table, config["vocab_size"])
    assert config["eos_token_id"] in table and 1 < len(table) <= config["vocab_size"]
    assert checkpoint_token_map(trained) == str(trained / "freq_2048.json")


def test_released_key_set_matches_the_test_checkpoints(trained, tmp_path):
    from safetensors.torch import load_file

    from tests.tiny_checkpoints import build_tiny_v4_mtp_checkpoint

    ours = load_file(str(trained / "model.safetensors"))
    reference = load_file(str(build_tiny_v4_mtp_checkpoint(tmp_path)[0] / "model.safetensors"))

    def families(names):  # layer and expert indices differ between the two shapes
        return {re.sub(r"\.\d+\.", ".N.", name) for name in names}

    assert families(ours) == families(reference)
    assert ours["embed.weight"].dtype == torch.bfloat16
    assert ours["mtp.0.hc_head_fn"].dtype == torch.float32
    assert ours["layers.0.ffn.gate.tid2eid"].dtype == torch.int64


def test_tokenizer_loads_with_chat_template(any_trained):
    tokenizer = load_tokenizer(any_trained, required=True)
    assert tokenizer(PROMPT)["input_ids"][0] == tokenizer.bos_token_id == 0
    assert tokenizer.eos_token_id == 1
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|bos|><|user|>\nhi\n<|assistant|>\n"


def test_engine_serves_it_plain_and_with_nextn(any_trained):
    plain = Engine(model_path=str(any_trained), dtype="float32")
    reference = plain.generate(PROMPT, GREEDY)
    assert len(reference["output_ids"]) > 0 and isinstance(reference["text"], str)
    nextn = Engine(
        model_path=str(any_trained),
        dtype="float32",
        speculative_algorithm="NEXTN",
        speculative_num_steps=3,
    )
    out = nextn.generate(PROMPT, GREEDY)
    assert out["output_ids"] == reference["output_ids"]  # greedy NEXTN is lossless
    assert out["meta_info"]["spec_verify_ct"] > 0


def test_transformers_loads_it_and_agrees_with_the_engine(any_trained):
    parity = transformers_parity(any_trained, [PROMPT], new_tokens=8)
    assert parity["equal"] == 1


def assert_runtime_equals_training_form(checkpoint: Path, draft_cls, seqs) -> None:
    """The training-form trunk and MTP on the saved weights against the runtime's paged
    target and draft: the last-row logits of a prompt of each length in `seqs`."""
    from runtime.cache import PagedTokenAllocator, ReqToTokenPool, SlotTable
    from runtime.configs.model_config import ModelConfig
    from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
    from runtime.execution.model_input import ModelInput

    model = load_checkpoint(checkpoint).eval()
    config = ModelConfig.from_path(checkpoint, "float32")
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, config.vocab_size, (1, 42), generator=generator)
    with torch.no_grad():
        trunk_logits, mtp_logits = model(tokens)
    for seq in seqs:
        table = SlotTable(ReqToTokenPool(4, 256), PagedTokenAllocator(64, 4))
        target = load_runner(config, table, max_tokens_per_pass=4)
        draft = load_runner(config, table, max_tokens_per_pass=4, model_cls=draft_cls)
        draft.model.set_embed_and_head(*target.model.get_embed_and_head())
        req = table.open_request()
        table.reserve(req, seq + 2)
        ids = tokens[0]
        out = target.forward(
            ModelInput(
                ForwardMode.EXTEND,
                ids[:seq],
                [req],
                [0],
                [seq],
                capture_hidden_mode=CaptureHiddenMode.FULL,
            )
        )
        step = draft.forward(
            ModelInput(
                ForwardMode.DRAFT_EXTEND,
                ids[1 : seq + 1],
                [req],
                [0],
                [seq],
                capture_hidden_mode=CaptureHiddenMode.LAST,
                captured_hidden_states=out.hidden_states,
            )
        )
        torch.testing.assert_close(
            out.next_token_logits[0], trunk_logits[0, seq - 1], atol=1e-4, rtol=1e-4
        )
        torch.testing.assert_close(
            step.next_token_logits[0], mtp_logits[0, seq - 1], atol=1e-4, rtol=1e-4
        )


def test_trained_mtp_is_the_runtime_draft(trained):
    """The training-form MTP (transformers block + h/e projections) and the runtime's paged
    draft give the same logits on the saved weights, as do the two trunks; the last rows
    lie past the CSA (top-k active) and HCA boundaries."""
    from runtime.models.deepseek_v4_mtp import DeepseekV4ForCausalLMNextN

    assert_runtime_equals_training_form(trained, DeepseekV4ForCausalLMNextN, (40, 23))


def test_chained_training_form_is_the_runtime_draft_chain(trained):
    """`chained_draft` (every pass of the chain over all rows at once, `chain_mask`) against
    the runtime's paged draft: an extend over the target's rows, then chained single-token
    steps that read the previous step's streams, each fed the next token of the text. Pass
    k at row r must equal the step-k logits of a chain whose verified rows end at r - k;
    the rows lie past the draft's window (16), so the mask's window is checked too."""
    from runtime.cache import PagedTokenAllocator, ReqToTokenPool, SlotTable
    from runtime.configs.model_config import ModelConfig
    from runtime.core.forward_mode import CaptureHiddenMode, ForwardMode
    from runtime.execution.model_input import ModelInput
    from runtime.models.deepseek_v4_mtp import DeepseekV4ForCausalLMNextN

    passes = 3
    model = load_checkpoint(trained).eval()
    config = ModelConfig.from_path(trained, "float32")
    tokens = torch.randint(
        3, config.vocab_size, (1, 44), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        _, chained = model.chained_draft(tokens, passes)
    ids = tokens[0]
    for verified in (9, 21, 37):  # verified rows 0..verified-1 (the last lies past the window)
        table = SlotTable(ReqToTokenPool(4, 256), PagedTokenAllocator(64, 4))
        target = load_runner(config, table, max_tokens_per_pass=4)
        draft = load_runner(
            config, table, max_tokens_per_pass=4, model_cls=DeepseekV4ForCausalLMNextN
        )
        draft.model.set_embed_and_head(*target.model.get_embed_and_head())
        req = table.open_request()
        table.reserve(req, verified + passes + 2)
        out = target.forward(
            ModelInput(
                ForwardMode.EXTEND, ids[:verified], [req], [0], [verified],
                capture_hidden_mode=CaptureHiddenMode.FULL,
            )
        )  # fmt: skip
        step = draft.forward(
            ModelInput(
                ForwardMode.DRAFT_EXTEND, ids[1 : verified + 1], [req], [0], [verified],
                capture_hidden_mode=CaptureHiddenMode.LAST,
                captured_hidden_states=out.hidden_states,
            )
        )  # fmt: skip
        row = verified - 1
        torch.testing.assert_close(
            step.next_token_logits[0], chained[0, 0, row], atol=1e-4, rtol=1e-4
        )
        for k in range(1, passes):
            row += 1
            step = draft.forward(
                ModelInput(
                    ForwardMode.DECODE, ids[row + 1 : row + 2], [req], [row], [1],
                    capture_hidden_mode=CaptureHiddenMode.LAST,
                    captured_hidden_states=step.hidden_states, spec_step_idx=k,
                )
            )  # fmt: skip
            torch.testing.assert_close(
                step.next_token_logits[0], chained[0, k, row], atol=1e-4, rtol=1e-4
            )


def test_distillation_fits_a_batch_and_changes_only_the_draft(trained, tmp_path):
    """The distillation loss falls as the MTP fits one batch (its gradient reaches the
    draft through every chained pass); `training.distill_draft` rewrites only `mtp.*`
    tensors, the model's output is unchanged, and the card says what was done."""
    from safetensors.torch import load_file

    from training import distill_draft
    from training.draft_distill import distill_loss, freeze_trunk_

    model = load_checkpoint(trained)
    params = freeze_trunk_(model)
    assert params and all(not p.requires_grad for p in model.trunk.parameters())
    optimizer = torch.optim.Adam(params, lr=3e-3)
    batch = torch.randint(
        3, model.config["vocab_size"], (2, 34), generator=torch.Generator().manual_seed(4)
    )
    first = None
    for _ in range(8):
        loss = distill_loss(*model.chained_draft(batch, 3))
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        assert all(p.grad is not None for p in model.mtp.block.self_attn.parameters())
        optimizer.step()
    assert distill_loss(*model.chained_draft(batch, 3)).item() < 0.7 * first

    out = tmp_path / "distilled"
    flags = ["--model-path", str(trained), "--output-dir", str(out), "--max-steps", "2"]
    flags += ["--max-minutes", "0", "--seq-len", "64", "--batch-size", "2", "--threads", "1"]
    distill_draft.main([*flags, "--eval-windows", "8", "--skip-runtime-eval"])
    before = load_file(str(trained / "model.safetensors"))
    after = load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("mtp.") for k in changed)
    summary = json.loads((out / "training.json").read_text())
    assert summary["draft_distillation"]["steps"] == 2
    assert len(summary["draft_distillation"]["agreement_after"]) == 3
    assert "## Draft distillation" in (out / "README.md").read_text()
    assert (out / "freq_2048.json").exists()
    # a further run in place keeps the first one's record, and the card lists both commands
    distill_draft.main(
        [
            "--model-path",
            str(out),
            *flags[4:],
            "--eval-windows",
            "8",
            "--skip-runtime-eval",
            "--max-steps",
            "1",
            "--seed",
            "1",
        ]
    )
    again = json.loads((out / "training.json").read_text())
    assert again["earlier_draft_distillations"] == [summary["draft_distillation"]]
    assert again["draft_distillation"]["steps"] == 1
    card = (out / "README.md").read_text()
    assert "after run 2" in card
    assert all(
        r["command"] in card for r in (summary["draft_distillation"], again["draft_distillation"])
    )
    plain = Engine(model_path=str(trained), dtype="float32").generate(PROMPT, GREEDY)
    nextn = Engine(
        model_path=str(out), dtype="float32", speculative_algorithm="NEXTN", speculative_num_steps=3
    ).generate(PROMPT, GREEDY)
    assert nextn["output_ids"] == plain["output_ids"]


@pytest.mark.parametrize("flags", [["--eval-threads", "0"], ["--num-steps", "0"]])
def test_distill_draft_refuses_bad_flags(flags, capsys):
    from training import distill_draft

    with pytest.raises(SystemExit) as exit_info:
        distill_draft.parse_args(flags)
    assert exit_info.value.code == 2 and flags[0] in capsys.readouterr().err


def test_trainer_refuses_zero_eval_threads(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_tiny_model.parse_args(["--eval-threads", "0"])
    assert exit_info.value.code == 2 and "--eval-threads" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# Qwen4Exp


def test_qwen_checkpoint_directory(qwen_trained):
    from safetensors.torch import load_file

    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {
        p.name for p in qwen_trained.iterdir()
    }
    config = json.loads((qwen_trained / "config.json").read_text())
    assert config["architectures"] == ["Qwen4ExpForCausalLM"]
    assert config["mtp_num_hidden_layers"] == 1 and config["torch_dtype"] == "bfloat16"
    assert set(config["layer_types"]) == {"linear_attention", "full_attention"}
    assert config["ple_layer_ids"] == [2] and config["split_ngram_parts"] == 4
    summary = json.loads((qwen_trained / "training.json").read_text())
    assert summary["steps"] == 3 and summary["heldout"]["mtp"] > 0
    assert "Qwen4Exp" in (qwen_trained / "README.md").read_text()
    tensors = load_file(str(qwen_trained / "model.safetensors"))
    assert tensors["mtp.fc_hidden.weight"].dtype == torch.bfloat16
    assert tensors["model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight"].ndim == 2
    assert tensors["model.layers.1.ple.ple_embedding.layer_multipliers"].dtype == torch.int64


def test_qwen_released_keys_load_without_gaps_or_leftovers(qwen_trained):
    """The 31 released `mtp.*` names; the runtime's target and draft loaders each take every
    tensor meant for them (none unexpected, none missing) and skip only the other's."""
    from safetensors.torch import load_file

    from runtime.configs.model_config import ModelConfig
    from runtime.models.qwen4_exp import Qwen4ExpForCausalLM, map_checkpoint_name
    from runtime.models.qwen4_exp_mtp import Qwen4ExpMTP
    from tests.models.test_mtp import released_qwen_mtp_keys

    tensors = load_file(str(qwen_trained / "model.safetensors"))
    assert {n for n in tensors if n.startswith("mtp.")} == set(released_qwen_mtp_keys())
    hf_config = ModelConfig.from_path(qwen_trained, "float32").hf_config
    target, draft = Qwen4ExpForCausalLM(hf_config), Qwen4ExpMTP(hf_config)
    loads = {
        "target": target.fill_weights(tensors.items()),
        "draft": draft.fill_weights(tensors.items()),
    }
    for tracker in loads.values():
        assert tracker.unexpected == [] and tracker.missing() == {}
    skipped = {n for n in tensors if map_checkpoint_name(n) is None}
    hash_tables = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
    assert {n for n in skipped if not n.startswith("mtp.")} == {
        f"model.layers.1.ple.ple_embedding.{table}" for table in hash_tables
    }


def test_qwen_trained_mtp_is_the_runtime_draft(qwen_trained):
    """The training-form trunk and MTP (transformers modules, the vectorised QSA indexer)
    and the runtime's paged target and draft give the same logits on the saved weights,
    with QSA keeping every block (11 rows) and selecting among them (40 rows)."""
    from runtime.models.qwen4_exp_mtp import Qwen4ExpMTP

    assert_runtime_equals_training_form(qwen_trained, Qwen4ExpMTP, (40, 11))


def test_vectorised_qsa_indexer_selects_as_transformers_does():
    """The training-form indexer (one pass over all queries) against transformers' own
    (a Python loop over queries), with selection active (37 rows, budget 16)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import (
        Qwen4ExpTextQSAIndexer,
        Qwen4ExpTextRotaryEmbedding,
    )

    qwen = qwen4_exp
    args = train_tiny_model.parse_args([f"--{k}={v}" for k, v in QWEN_TINY_SHAPE.items()])
    config = qwen.hf_config(qwen.model_config(args, 384, TOKEN_IDS))
    torch.manual_seed(0)
    indexer = Qwen4ExpTextQSAIndexer(config, layer_idx=3)
    for param in indexer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    hidden = torch.randn(2, 37, config.hidden_size)
    positions = torch.arange(37).view(1, 1, -1).expand(-1, 2, -1)
    rope = Qwen4ExpTextRotaryEmbedding(config)(hidden, positions)  # per batch row, as HF needs
    mask = qwen.causal_mask(37, "cpu").expand(2, 1, 37, 37)
    with torch.no_grad():
        expected = indexer(hidden, rope, mask, None)
        ours = qwen.causal_qsa_indexer_forward(indexer, hidden, rope, mask)
    assert torch.equal(ours, expected)
    assert not expected[:, 0, -1].all()  # the last rows kept only some blocks
