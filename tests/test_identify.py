# SPDX-License-Identifier: Apache-2.0
"""Gate training on SmolLM2 (CPU, short prompts): only the gates learn, they stay in [0, 1], the pattern is valid."""
import dataclasses
import math
import random

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from vllm_duo.pattern import HeadPattern, PatternError, find_bundled, read_hf_config
from vllm_duo.tools import cli, pattern_commands
from vllm_duo.tools.accuracy import identify, training
from vllm_duo.tools.accuracy.passkey import ORDINAL_NEEDLE, multi_passkey_prompt

SETTINGS = training.IdentifySettings(steps=3, context_len=256, sink=8, recent=32, passkeys=2, seed=0)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on a small shared machine two OpenMP threads next to a busy vLLM worker run 10-50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_prompt_puts_every_needle_out_of_the_streaming_window(smollm2_dir):
    trainer_tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    sample = multi_passkey_prompt(trainer_tokenizer, 512, random.Random(0), 3, sink=8, recent=32)
    assert len(sample.input_ids) <= 512 and len(set(sample.passkeys)) == 3
    first_question = sample.supervised[0]
    assert sample.supervised == list(range(first_question, len(sample.input_ids)))
    for start, passkey in zip(sample.needle_starts, sample.passkeys):
        needle = trainer_tokenizer.decode(sample.input_ids[start:start + 30])
        assert passkey in needle and start >= 8
    qa = trainer_tokenizer.decode(sample.input_ids[first_question:])
    assert all(passkey in qa for passkey in sample.passkeys)
    last_needle_end = sample.needle_starts[-1] + len(trainer_tokenizer(" " + ORDINAL_NEEDLE.format(
        ordinal="third", passkey=sample.passkeys[-1]), add_special_tokens=False).input_ids)
    assert last_needle_end <= first_question - 32


def test_a_repeated_haystack_repeats_one_paragraph_and_the_trainer_mixes_it_in(smollm2_dir, monkeypatch):
    """--repeated-haystack: that share of prompts repeats one short paragraph (the classic test's kind of haystack),
    needles still out of the window; the others keep varied sentences."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    sample = multi_passkey_prompt(tokenizer, 1024, random.Random(1), 3, sink=8, recent=32, period=4)
    text = tokenizer.decode(sample.input_ids[:sample.needle_starts[0]])
    sentences = [s.strip() for s in text.split(".")[1:-1] if s.strip()]  # after the intro's first sentence
    paragraph = sentences[2:6]
    assert len(set(paragraph)) == 4 and all(s == paragraph[i % 4] for i, s in enumerate(sentences[2:]))
    varied = tokenizer.decode(multi_passkey_prompt(tokenizer, 1024, random.Random(1), 3, sink=8, recent=32).input_ids)
    assert len(set(varied.split("."))) > 20
    periods = []
    monkeypatch.setattr(training, "multi_passkey_prompt", lambda *args, period=None, **kwargs: periods.append(period))
    trainer = training.GateTrainer.__new__(training.GateTrainer)  # sample() needs only the settings here
    trainer.settings, trainer.tokenizer = dataclasses.replace(SETTINGS, repeated=0.5), None
    for index in range(200):
        trainer.sample(index)
    repeated = [p for p in periods if p is not None]
    assert 70 < len(repeated) < 130 and set(repeated) == set(range(3, 9))
    with pytest.raises(PatternError, match="repeated-haystack share"):
        dataclasses.replace(SETTINGS, repeated=1.5).check()


def test_schedule_is_the_reference_trapezoid():
    factors = [training.lr_factor(step, 100) for step in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[19] == 1.0 and factors[50] == 1.0
    assert factors[-1] == pytest.approx(0.1) and factors[90] == pytest.approx(0.5)
    assert [training.lr_factor(step, 3) for step in range(3)] == [1.0, 1.0, 1.0]


def test_only_the_gates_train_and_stay_in_range(smollm2_dir, tmp_path):
    trainer = training.GateTrainer(smollm2_dir, SETTINGS)
    frozen = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "duo_gate" not in name}
    history = [trainer.step(step) for step in range(SETTINGS.steps)]

    assert all(math.isfinite(s.loss) for s in history)
    gates = trainer.gate_matrix()
    shape = read_hf_config(smollm2_dir)
    assert gates.shape == (shape.num_layers, shape.num_kv_heads)
    assert gates.min() >= 0.0 and gates.max() <= 1.0
    assert history[-1].loss < history[0].loss or (gates < 0.999).any()
    assert (gates < 0.999).any()
    for name, param in trainer.model.named_parameters():
        if "duo_gate" in name:
            assert param.requires_grad and param.grad is not None
        else:
            assert not param.requires_grad and param.grad is None
            assert torch.equal(param, frozen[name]), name

    result = training.TrainResult(gates=gates, history=history, wall_s=1.0)
    pattern = identify.build_pattern(smollm2_dir, SETTINGS, result, date="2026-11-23")
    pattern.check_model(*shape)
    path = tmp_path / "trained.json"
    pattern.save(path)
    loaded = HeadPattern.load(path)
    assert np.allclose(loaded.gates, gates, atol=1e-6) and (loaded.sink, loaded.recent) == (8, 32)  # as trained
    assert "Trained with sink/recent 8/32, deployed with 8/32" in loaded.provenance.notes
    redeployed = identify.build_pattern(smollm2_dir, SETTINGS, result, deploy_sink=64, deploy_recent=256)
    assert (redeployed.sink, redeployed.recent) == (64, 256) and "deployed with 64/256" in redeployed.provenance.notes
    assert "reg_weight 0.05" in loaded.provenance.method and "final loss" in loaded.provenance.notes
    assert "45 of 90" in pattern_commands.show(str(path), None, 8192, str(tmp_path / "gates.png"))
    assert (tmp_path / "gates.png").stat().st_size > 0


def test_layer_gates_train_one_value_per_layer(smollm2_dir, tmp_path):
    """--layer-gates (ZigzagAttention's fine-tuning): one trained gate per layer, repeated over its KV heads in the
    pattern, named in the provenance; its checkpoint never resumes a per-head run."""
    settings = dataclasses.replace(SETTINGS, layer_gates=True, steps=2)
    trainer = training.GateTrainer(smollm2_dir, settings)
    assert [gate.shape for gate in trainer.gates] == [torch.Size([1])] * trainer.num_layers
    history = [trainer.step(step) for step in range(settings.steps)]
    assert all(gate.grad is not None and gate.grad.shape == (1,) for gate in trainer.gates)
    gates = trainer.gate_matrix()
    assert gates.shape == (trainer.num_layers, trainer.num_kv_heads)
    assert (gates == gates[:, :1]).all() and (gates < 0.999).any()
    pattern = identify.build_pattern(smollm2_dir, settings, training.TrainResult(gates=gates, history=history))
    method = pattern.provenance.method
    assert "one gate per layer shared by its KV heads (ZigzagAttention's layer-wise alphas)" in method

    checkpoint = tmp_path / "state.pt"
    trainer.save(checkpoint, settings.steps, history, 1.0)
    with pytest.raises(PatternError, match=r"other settings \(layer_gates\)"):
        training.GateTrainer(smollm2_dir, dataclasses.replace(settings, layer_gates=False)).load(checkpoint)


def test_cli_writes_a_valid_pattern(smollm2_dir, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert cli.main(["identify", "--model", smollm2_dir, "-o", str(out), "--steps", "2", "--context-len", "256",
                     "--min-context-len", "200", "--passkeys", "2", "--sink", "8", "--recent", "32",
                     "--device", "cpu"]) == 0
    assert "wrote" in capsys.readouterr().out
    pattern = HeadPattern.load(out)
    assert pattern.provenance.source == identify.SOURCE and pattern.sparsity == 0.5
    assert "2 steps" in pattern.provenance.method


def test_a_stopped_run_continues_to_the_gates_of_an_uninterrupted_one(smollm2_dir, tmp_path):
    """A device command's time limit stops identify with its state saved; running it again finishes the same run."""
    straight = training.train(smollm2_dir, SETTINGS, progress=False)
    checkpoint, out = tmp_path / "state.pt", tmp_path / "p.json"
    with pytest.raises(PatternError, match="needs a checkpoint"):
        identify.identify(smollm2_dir, out, SETTINGS, progress=False, time_limit=60)
    message = identify.identify(smollm2_dir, out, SETTINGS, progress=False, checkpoint=checkpoint, time_limit=0)
    assert message.startswith(f"stopped at step 1 of {SETTINGS.steps}") and not out.exists()

    resumed = training.train(smollm2_dir, SETTINGS, progress=False, checkpoint=checkpoint)
    assert training.checkpoint_steps(checkpoint) == SETTINGS.steps == len(resumed.history)
    assert np.array_equal(resumed.gates, straight.gates)
    assert [s.loss for s in resumed.history] == [s.loss for s in straight.history]
    assert "wrote" in identify.identify(smollm2_dir, out, SETTINGS, progress=False, checkpoint=checkpoint)
    assert np.allclose(HeadPattern.load(out).gates, straight.gates, atol=1e-6)  # the file keeps 6 decimals

    with pytest.raises(PatternError, match=r"other settings \(lr\)"):
        training.train(smollm2_dir, dataclasses.replace(SETTINGS, lr=0.01), progress=False, checkpoint=checkpoint)


def dense_lambda_attention(query, key, value, sink, recent, scale=None):
    """Reference: SDPA with the dense [T, T] Λ mask: key k visible to q iff k <= q and (k < sink or k > q - recent)."""
    q = torch.arange(query.shape[2])[:, None]
    k = torch.arange(query.shape[2])[None, :]
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=(k <= q) & ((k < sink) | (k > q - recent)), scale=scale)


@pytest.mark.parametrize("length, sink, recent, batch", [
    (1, 4, 16, 1), (20, 8, 32, 1),  # shorter than sink + recent
    (100, 8, 32, 2),  # not a multiple of the block
    (96, 0, 32, 1), (300, 0, 20, 1),  # no sink; recent not a multiple of 16
    (700, 64, 256, 1),  # the deployed sink/recent
    (200, 40, 16, 1),  # sink longer than the block
])
def test_blocked_streaming_attention_equals_the_dense_lambda_mask(length, sink, recent, batch):
    """9 query heads on 3 KV heads as in SmolLM2, broadcast the way gated_attention does; gradients too."""
    generator = torch.Generator().manual_seed(length)
    query, key, value = (torch.randn(batch, heads, length, 16, generator=generator, requires_grad=True)
                         for heads in (9, 3, 3))
    mixing = training._Mixing(sink, recent)
    inputs = (query, key.repeat_interleave(3, dim=1), value.repeat_interleave(3, dim=1))
    blocked, dense = mixing.streaming(*inputs), dense_lambda_attention(*inputs, sink, recent)
    assert torch.allclose(blocked, dense, atol=1e-5)
    weights = torch.randn(dense.shape, generator=generator)
    blocked_grads = torch.autograd.grad((blocked * weights).sum(), (query, key, value))
    dense_grads = torch.autograd.grad((dense * weights).sum(), (query, key, value))
    assert all(torch.allclose(b, d, atol=1e-5) for b, d in zip(blocked_grads, dense_grads))
    assert mixing.layout(length, query.device, query.dtype)[1].shape[-1] % 16 == 0


def test_gate_gradient_equals_the_dense_lambda_formulation(smollm2_dir, monkeypatch):
    """distill_loss's gate gradients with blocked streaming attention equal those with the dense Λ mask."""
    trainer = training.GateTrainer(smollm2_dir, SETTINGS)
    with torch.no_grad():
        for gate in trainer.gates:
            gate.uniform_(0.2, 0.8, generator=torch.Generator().manual_seed(0))
    sample = trainer.sample(0)

    def gate_grads():
        for gate in trainer.gates:
            gate.grad = None
        trainer.distill_loss(sample).backward()
        return torch.stack([gate.grad for gate in trainer.gates])

    blocked = gate_grads()
    monkeypatch.setattr(training._Mixing, "streaming", lambda self, query, key, value, scale=None:
                        dense_lambda_attention(query, key, value, self.sink, self.recent, scale))
    dense = gate_grads()
    assert blocked.abs().max() > 0 and torch.allclose(blocked, dense, rtol=1e-4, atol=1e-6)


def test_defaults_follow_the_paper_and_the_deployed_window(smollm2_dir, monkeypatch):
    """Train with the deployed sink/recent 64/256; on GPU prompts from 1000 tokens, lengths from 50 values."""
    defaults = training.IdentifySettings()
    assert (defaults.sink, defaults.recent, defaults.steps) == (64, 256, 2000)
    assert identify.default_min_context_len(32000, "cuda") == 1000
    assert identify.default_min_context_len(32000, "cuda", sink=64, recent=512) == 1256  # room for the passkeys
    assert identify.default_min_context_len(2048, "cpu") == 1024
    assert identify.default_context_len(smollm2_dir, "cpu") == 2048
    settings = dataclasses.replace(SETTINGS, context_len=1000, min_context_len=510)
    trainer = training.GateTrainer.__new__(training.GateTrainer)  # sample() needs only the settings here
    trainer.settings, trainer.tokenizer = settings, None
    monkeypatch.setattr(training, "multi_passkey_prompt", lambda tokenizer, length, *args, **kwargs: length)
    drawn = {trainer.sample(index) for index in range(40)}
    assert len(drawn) > 10 and drawn <= set(np.linspace(510, 1000, 50).round().astype(int).tolist())
    result = training.TrainResult(gates=np.ones((30, 3)), history=[training.StepStats(1, 1, 0, 0.02, 1)])
    method = identify.build_pattern(smollm2_dir, settings, result).provenance.method
    assert "drawn uniformly from 50 evenly spaced values in [510, 1000]" in method
    with pytest.raises(PatternError, match="min context length"):
        dataclasses.replace(SETTINGS, min_context_len=300).check()


@pytest.fixture
def init_pattern(tmp_path):
    """The bundled SmolLM2 pattern served with the tests' short window 8/32, so a 256-token prompt streams."""
    bundled = HeadPattern.load(find_bundled("SmolLM2-135M-Instruct"))
    path = tmp_path / "init.json"
    bundled.model_copy(update={"sink": SETTINGS.sink, "recent": SETTINGS.recent}).save(path)
    return path


def test_a_target_sparsity_forwards_exactly_the_binarized_mask(smollm2_dir, init_pattern):
    """--target-sparsity: the forward pass mixes with each gate's hard value at S (the served mask), and the gates
    get the gradient of that mix (straight-through), as if the gates were the 0/1 mask."""
    settings = dataclasses.replace(SETTINGS, target_sparsity=0.25, init_pattern=str(init_pattern))
    trainer = training.GateTrainer(smollm2_dir, settings)
    gates = np.asarray(HeadPattern.load(init_pattern).gates)  # the gates' own ranking, not the bundled 0.25 mask
    served = HeadPattern._binarize(gates, 0.25)
    hard = trainer.hard_gates()
    assert torch.equal(hard, torch.from_numpy(served).float()) and 0 < hard.sum() < hard.numel()
    sample = trainer.sample(0)
    ids = torch.tensor([sample.input_ids])

    def hidden_and_gate_grads():
        for gate in trainer.gates:
            gate.grad = None
        trainer.distill_loss(sample).backward()
        with torch.no_grad():
            hidden = trainer.model.base_model(input_ids=ids, use_cache=False, duo_mix=trainer.mixing)
        return hidden.last_hidden_state, torch.stack([gate.grad for gate in trainer.gates])

    trainer.mixing.hard_gates = hard
    straight_through, straight_through_grads = hidden_and_gate_grads()
    trainer.mixing.hard_gates = None
    with torch.no_grad():
        for gate, row in zip(trainer.gates, hard):
            gate.copy_(row)
    binary, binary_grads = hidden_and_gate_grads()
    assert torch.equal(straight_through, binary) and torch.equal(straight_through_grads, binary_grads)
    assert (straight_through_grads != 0).all()  # streaming heads' gates move too


def test_a_target_sparsity_trains_a_ranking_by_centered_gradients_without_clamping(smollm2_dir, init_pattern):
    """Every head would gain from full attention, so raw gradients would lift all gates alike and clamping would
    tie them at 1: a step centers the gate gradients (they sum to 0) and leaves the gates unclamped."""
    settings = dataclasses.replace(SETTINGS, steps=4, lr=2.0, target_sparsity=0.25, init_pattern=str(init_pattern))
    trainer = training.GateTrainer(smollm2_dir, settings)
    trainer.step(0)
    grads = torch.cat([gate.grad for gate in trainer.gates])
    assert abs(float(grads.sum())) < 1e-5 * float(grads.abs().sum()) and (grads != 0).any()
    gates = torch.cat([gate.detach() for gate in trainer.gates])
    assert (gates > 1.0).any() and (gates < 0.0).any()  # lr 2: one step moves gates past both ends


def test_a_fine_tune_adds_its_trained_mask_to_the_initial_pattern(smollm2_dir, init_pattern, tmp_path, capsys):
    """identify --target-sparsity 0.25 --init-pattern P writes P with masks["0.25"] = the mask of the trained gates
    (no L1 term); the pattern serves that mask at 0.25 and its gates' ranking at 0.5."""
    settings = dataclasses.replace(SETTINGS, steps=2, target_sparsity=0.25, init_pattern=str(init_pattern))
    result = training.train(smollm2_dir, settings, progress=False)
    assert all(stats.reg == 0.0 for stats in result.history)
    initial = HeadPattern.load(init_pattern)
    assert not np.array_equal(result.gates, np.array(initial.gates))
    pattern = identify.build_pattern(smollm2_dir, settings, result, date="2026-11-27")
    trained = HeadPattern._binarize(result.gates, 0.25)
    assert np.array_equal(np.array(pattern.masks["0.25"], dtype=bool), trained)
    assert np.array_equal(pattern.retrieval_mask_at(0.25), trained)
    assert np.array_equal(pattern.retrieval_mask_at(0.5), initial.retrieval_mask_at(0.5))
    assert pattern.gates == initial.gates and pattern.sparsity == initial.sparsity
    assert pattern.provenance.notes.startswith(initial.provenance.notes)
    notes = pattern.provenance.notes
    assert 'masks["0.25"]: trained by vllm-duo identify --target-sparsity 0.25 (2026-11-27)' in notes
    assert "straight-through" in notes and "no L1 term" in notes

    out = tmp_path / "p.json"
    assert cli.main(["identify", "--model", smollm2_dir, "-o", str(out), "--steps", "2", "--context-len", "256",
                     "--min-context-len", "256", "--passkeys", "2", "--seed", "0", "--device", "cpu",
                     "--target-sparsity", "0.25",
                     "--init-pattern", str(init_pattern)]) == 0
    assert 'sparsity 0.25 (trained mask masks["0.25"])' in capsys.readouterr().out
    written = HeadPattern.load(out)
    assert written.model_dump(exclude={"provenance"}) == pattern.model_dump(exclude={"provenance"})


def test_a_target_sparsity_from_scratch_stores_its_mask_and_bad_combinations_are_refused(smollm2_dir):
    settings = dataclasses.replace(SETTINGS, target_sparsity=0.25)
    gates = np.random.default_rng(0).uniform(size=(30, 3))
    result = training.TrainResult(gates=gates, history=[training.StepStats(1, 1, 0, 0.02, 0.5)])
    pattern = identify.build_pattern(smollm2_dir, settings, result)
    assert pattern.sparsity == 0.25 and pattern.masks.keys() == {"0.25"}
    assert np.array_equal(pattern.retrieval_mask_at(), HeadPattern._binarize(gates, 0.25))
    assert "hard value at sparsity 0.25" in pattern.provenance.method

    for change, named in [({"layer_gates": True}, "drop --layer-gates"), ({"target_sparsity": 1.0}, r"\(0, 1\)"),
                          ({"target_sparsity": None, "init_pattern": "smollm2"}, "add --target-sparsity")]:
        with pytest.raises(PatternError, match=named):
            dataclasses.replace(settings, **change).check()
    bundled = dataclasses.replace(settings, init_pattern="smollm2")  # served with sink 64, recent 512
    with pytest.raises(PatternError, match=r"sink/recent 8/32 differ from the initial pattern's 64/512 \(bundled"):
        training.initial_pattern(bundled, smollm2_dir)
