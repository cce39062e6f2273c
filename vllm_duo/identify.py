# SPDX-License-Identifier: Apache-2.0
"""Retrieval-head identification: DuoAttention gate training on synthetic multi-passkey prompts (`vllm-duo identify`).

Haystack: the varied filler sentences of `vllm_duo.scoring` (subject, verb, object and ending drawn from fixed lists,
12^4 sentences, no digits), generated offline from a seed. The reference trains on BookSum chapters, which are not
available offline; repeated text ("The grass is green. ...") gives every token an exact copy one period back that
copy heads latch onto, and it is far from what a model reads. Varied digit-free sentences avoid both, and the
passkeys are the only numbers in the prompt, so the question tokens can only be answered from the needles.
"""
from __future__ import annotations

import json
import os
import random
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

from vllm_duo.pattern import HeadPattern, PatternError, read_hf_config
from vllm_duo.scoring import INTRO, haystack

SOURCE = "vllm-duo identify"
SAVE_EVERY = 50  # steps between checkpoint writes, when a checkpoint path is given
_ATTENTION = "duo_gated"
# The multi-key versions of scoring.py's NEEDLE and QUESTION: with several keys each needs a name.
NEEDLE = "The {ordinal} pass key is {passkey}. Remember it. {passkey} is the {ordinal} pass key."
QUESTION = "What is the {ordinal} pass key? The {ordinal} pass key is"
ANSWER = "{passkey}."
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
            "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
            "eighteenth", "nineteenth", "twentieth")


@dataclass(frozen=True)
class IdentifySettings:
    """Hyperparameters of one gate-training run; defaults are the reference's (lr 0.02, reg 0.05, 2000 steps)."""

    steps: int = 2000
    context_len: int = 8192
    min_context_len: int | None = None  # None: every sample has context_len tokens
    batch_size: int = 1  # samples per step and process
    lr: float = 0.02
    reg_weight: float = 0.05
    sink: int = 128
    recent: int = 256
    passkeys: int = 10
    seed: int = 42
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    grad_checkpoint: bool = False
    device: str | None = None  # None: cuda when available, else cpu

    def check(self) -> None:
        """Rejects impossible settings before minutes of model loading."""
        problems = []
        if self.steps < 1 or self.batch_size < 1 or self.context_len < 1:
            problems.append("steps, batch size and context length must be positive")
        if self.min_context_len is not None and not 1 <= self.min_context_len <= self.context_len:
            problems.append(f"min context length {self.min_context_len} must be in [1, {self.context_len}]")
        if not 1 <= self.passkeys <= len(ORDINALS):
            problems.append(f"passkeys must be in [1, {len(ORDINALS)}]")
        if self.sink < 0 or self.recent < 1:
            problems.append("sink must be >= 0 and recent >= 1")
        if self.lr <= 0 or self.reg_weight < 0:
            problems.append("lr must be positive and reg weight non-negative")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            problems.append(f"dtype {self.dtype} is not float32, bfloat16 or float16")
        if problems:
            raise PatternError("; ".join(problems))


def default_context_len(model_dir: str | Path, device: str | None = None) -> int:
    """On GPU the model's usable context (max_position_embeddings, at most the reference's 32000); 2048 on CPU,
    where a step at 8k tokens takes minutes."""
    cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if not cuda:
        return 2048
    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return min(int(config.get("max_position_embeddings") or 32000), 32000)


@dataclass(frozen=True)
class PasskeySample:
    """One tokenized training prompt; `supervised` are the question and answer token positions the loss reads."""

    input_ids: list[int]
    supervised: list[int]
    passkeys: list[str]
    needle_starts: list[int]


def multi_passkey_prompt(tokenizer, context_len: int, rng: random.Random, num_passkeys: int, *, sink: int,
                         recent: int) -> PasskeySample:
    """`num_passkeys` 5-digit passkeys at random depths of a haystack, then a question and answer for each.

    Like scoring.passkey_prompt, needles go between haystack sentences and only where a streaming head with
    `sink` + `recent` cannot see them from the questions: after the first `sink` tokens and more than `recent`
    tokens before the first question. So each supervised token needs the full-attention heads to be right.
    """
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    passkeys = [str(rng.randint(10000, 99999)) for _ in range(num_passkeys)]
    ordinals = ORDINALS[:num_passkeys]
    intro = encode(INTRO)
    needles = [encode(" " + NEEDLE.format(ordinal=o, passkey=p)) for o, p in zip(ordinals, passkeys)]
    qa = [encode(" " + QUESTION.format(ordinal=o)) + encode(" " + ANSWER.format(passkey=p))
          for o, p in zip(ordinals, passkeys)]
    budget = context_len - len(intro) - sum(map(len, needles)) - sum(map(len, qa))
    sentences = haystack(encode, rng, budget)
    haystack_len = sum(map(len, sentences))

    # Token offset before sentence i counting intro and haystack only; a needle placed there moves by the needles
    # before it, and the last one must still end more than `recent` tokens before the first question.
    starts = np.cumsum([len(intro)] + [len(sentence) for sentence in sentences])
    question_start = len(intro) + haystack_len + sum(map(len, needles))
    last_end_limit = question_start - recent - sum(map(len, needles))
    places = [i for i, start in enumerate(starts) if sink <= start <= last_end_limit]
    if len(places) < num_passkeys:
        raise PatternError(
            f"context length {context_len} leaves {len(places)} places for {num_passkeys} passkeys outside sink "
            f"{sink} + recent {recent} tokens: raise the context length or lower --passkeys, --sink or --recent")
    chosen = sorted(rng.sample(places, num_passkeys))

    input_ids, needle_starts, previous = list(intro), [], 0
    for place, needle in zip(chosen, needles):
        input_ids += [token for sentence in sentences[previous:place] for token in sentence]
        needle_starts.append(len(input_ids))
        input_ids += needle
        previous = place
    input_ids += [token for sentence in sentences[previous:] for token in sentence]
    assert len(input_ids) == question_start
    for block in qa:
        input_ids += block
    return PasskeySample(input_ids=input_ids, supervised=list(range(question_start, len(input_ids))),
                         passkeys=passkeys, needle_starts=needle_starts)


class _Mixing:
    """Passed through the model's forward kwargs: tells the attention function to mix full and streaming outputs."""

    def __init__(self, sink: int, recent: int):
        self.sink, self.recent = sink, recent
        self._masks: dict[tuple[int, str], torch.Tensor] = {}

    def lambda_mask(self, length: int, device: torch.device) -> torch.Tensor:
        """Bool [T, T]: key k visible to query q iff k <= q and (k < sink or k > q - recent); built once per length."""
        key = (length, str(device))
        if key not in self._masks:
            q = torch.arange(length, device=device)[:, None]
            k = torch.arange(length, device=device)[None, :]
            self._masks[key] = (k <= q) & ((k < self.sink) | (k > q - self.recent))
        return self._masks[key]


def gated_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, duo_mix=None, **kwargs):
    """alpha * causal + (1 - alpha) * Λ-masked attention per KV head, alpha = `module.duo_gate` (GQA-broadcast).

    Without `duo_mix` (the teacher pass) it is plain causal attention. The HF mask is ignored: training sequences
    are single and unpadded, queries and keys are the same positions (no cache).
    """
    num_heads, length = query.shape[1], query.shape[2]
    groups = num_heads // key.shape[1]
    if key.shape[2] != length:
        raise RuntimeError("gated attention expects a full forward without a KV cache (use_cache=False)")
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    full = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    if duo_mix is not None:
        streaming = F.scaled_dot_product_attention(query, key, value, scale=scaling,
                                                   attn_mask=duo_mix.lambda_mask(length, query.device))
        gate = module.duo_gate.to(query.dtype).repeat_interleave(groups).view(1, num_heads, 1, 1)
        full = streaming + gate * (full - streaming)
    return full.transpose(1, 2).contiguous(), None


def lr_factor(step: int, steps: int) -> float:
    """The reference's trapezoid: linear warmup over the first 20% of steps, flat, linear decay over the last 20%.

    Both ramps are floored at 0.1 of the peak lr (duo_attn/train.py's LambdaLR); at least one step per ramp.
    """
    ramp = max(1, steps // 5)
    return min(1.0, max((step + 1) / ramp, 0.1), max((steps - step) / ramp, 0.1))


@dataclass
class StepStats:
    """What one optimizer step reports (averaged over processes)."""

    loss: float
    distill: float
    reg: float
    lr: float
    mean_gate: float


@dataclass
class TrainResult:
    """Trained gates [num_layers, num_kv_heads] and the run's record, for the pattern's provenance."""

    gates: np.ndarray
    history: list[StepStats] = field(default_factory=list)
    wall_s: float = 0.0
    world_size: int = 1
    device: str = "cpu"
    dtype: str = "float32"


class GateTrainer:
    """The frozen model with one trainable gate per KV head and layer, and the AdamW step over those gates."""

    def __init__(self, model_dir: str | Path, settings: IdentifySettings, *, rank: int = 0, world_size: int = 1,
                 device: str | torch.device | None = None):
        settings.check()
        self.settings, self.rank, self.world_size = settings, rank, world_size
        device = device or settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        self.dtype = getattr(torch, settings.dtype or ("bfloat16" if self.device.type == "cuda" else "float32"))
        AttentionInterface.register(_ATTENTION, gated_attention)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=self.dtype,
                                                          attn_implementation=_ATTENTION).to(self.device)
        self.model.requires_grad_(False)
        if settings.grad_checkpoint:
            # Non-reentrant: the inputs of each layer do not require grad, only the gates inside it do.
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.train()  # transformers checkpoints only in training mode; the model has no dropout
        else:
            self.model.eval()
        config = self.model.config
        self.num_layers, self.num_kv_heads = config.num_hidden_layers, config.num_key_value_heads
        attention = {m.layer_idx: m for m in self.model.modules()
                     if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")}
        if sorted(attention) != list(range(self.num_layers)):
            raise PatternError(f"{model_dir}: found attention modules for layers {sorted(attention)}, expected "
                               f"0..{self.num_layers - 1}: this architecture is not supported by identify")
        self.gates: list[torch.nn.Parameter] = []
        for layer in range(self.num_layers):
            gate = torch.nn.Parameter(torch.ones(self.num_kv_heads, device=self.device, dtype=torch.float32))
            attention[layer].duo_gate = gate  # a registered Parameter of the module, float32 whatever the model dtype
            self.gates.append(gate)
        # weight_decay 0 as in the reference: the L1 term is the only pull on the gates.
        self.optimizer = torch.optim.AdamW(self.gates, lr=settings.lr, weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda step: lr_factor(step, settings.steps))
        self.mixing = _Mixing(settings.sink, settings.recent)

    def sample(self, index: int) -> PasskeySample:
        """The index-th training prompt of the run; depends only on the seed and index, not on the process count."""
        rng = random.Random(f"{self.settings.seed}/{index}")
        low = self.settings.min_context_len or self.settings.context_len
        length = rng.randint(low, self.settings.context_len)
        return multi_passkey_prompt(self.tokenizer, length, rng, self.settings.passkeys, sink=self.settings.sink,
                                    recent=self.settings.recent)

    def distill_loss(self, sample: PasskeySample) -> torch.Tensor:
        """Mean over supervised tokens of the squared distance (averaged over the hidden size) between the final
        hidden states of the gated model and of the full-attention model (computed without grad)."""
        ids = torch.tensor([sample.input_ids], device=self.device)
        positions = torch.tensor(sample.supervised, device=self.device)
        with torch.no_grad():
            teacher = self.model.base_model(input_ids=ids, use_cache=False).last_hidden_state[0, positions].float()
        student = self.model.base_model(input_ids=ids, use_cache=False, duo_mix=self.mixing).last_hidden_state
        return (student[0, positions].float() - teacher).pow(2).mean(dim=-1).mean()

    def step(self, step: int) -> StepStats:
        """One AdamW step on batch_size samples per process; gate gradients averaged over processes, then clamped."""
        settings = self.settings
        self.optimizer.zero_grad(set_to_none=True)
        distill = 0.0
        for i in range(settings.batch_size):
            sample = self.sample((step * self.world_size + self.rank) * settings.batch_size + i)
            loss = self.distill_loss(sample) / settings.batch_size
            loss.backward()  # one sample at a time: the activations of one long prompt are what memory holds
            distill += loss.item()
        # L1 of the gates as their mean, so lambda means the same for any head count (the paper writes a sum; the
        # reference's loss.py was not available to check). Added on every process: the average below keeps it once.
        reg = settings.reg_weight * torch.cat(list(self.gates)).abs().mean()
        reg.backward()
        stats = torch.tensor([distill, reg.item()], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            import torch.distributed as dist

            grads = torch.stack([gate.grad for gate in self.gates])
            dist.all_reduce(grads)
            grads /= self.world_size
            for gate, grad in zip(self.gates, grads):
                gate.grad.copy_(grad)
            dist.all_reduce(stats)
            stats /= self.world_size
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        with torch.no_grad():
            for gate in self.gates:
                gate.clamp_(0.0, 1.0)
        distill, reg_value = stats.tolist()
        return StepStats(loss=distill + reg_value, distill=distill, reg=reg_value, lr=lr,
                         mean_gate=float(torch.cat([g.detach() for g in self.gates]).mean()))

    def gate_matrix(self) -> np.ndarray:
        """Float64 [num_layers, num_kv_heads] copy of the gates."""
        return torch.stack([gate.detach().float().cpu() for gate in self.gates]).double().numpy()

    def save(self, path: str | Path, steps_done: int, history: list[StepStats], wall_s: float) -> None:
        """Writes what a later run needs to continue exactly: gates, AdamW and schedule state, the loss history.

        Written to a temporary file and renamed, so a run killed mid-write leaves the previous checkpoint intact.
        """
        state = {"settings": _resumable(self.settings), "world_size": self.world_size, "steps_done": steps_done,
                 "gates": [gate.detach().cpu() for gate in self.gates], "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "history": [asdict(stats) for stats in history],
                 "wall_s": wall_s}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        torch.save(state, partial)
        os.replace(partial, path)

    def load(self, path: str | Path) -> tuple[int, list[StepStats], float]:
        """Restores a checkpoint of the same run; returns (steps done, history, wall seconds so far)."""
        state = torch.load(path, map_location=self.device, weights_only=True)
        mine = _resumable(self.settings)
        differ = sorted(k for k in mine if state["settings"].get(k) != mine[k])
        if state["world_size"] != self.world_size:
            differ.append(f"processes ({state['world_size']} there)")
        if differ:
            raise PatternError(f"checkpoint {path} belongs to a run with other settings ({', '.join(differ)}): "
                               "repeat that run's options, or delete the checkpoint to start over")
        with torch.no_grad():
            for gate, saved in zip(self.gates, state["gates"]):
                gate.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state["steps_done"], [StepStats(**stats) for stats in state["history"]], state["wall_s"]


def _resumable(settings: IdentifySettings) -> dict:
    """The settings a continued run must share with the one that wrote the checkpoint (the device may change)."""
    return {k: v for k, v in asdict(settings).items() if k != "device"}


def checkpoint_steps(path: str | Path) -> int:
    """Steps done in a checkpoint file."""
    return torch.load(path, map_location="cpu", weights_only=True)["steps_done"]


def train(model_dir: str | Path, settings: IdentifySettings, *, rank: int = 0, world_size: int = 1,
          device: str | None = None, progress: bool = True, checkpoint: str | Path | None = None,
          time_limit: float | None = None) -> TrainResult:
    """Trains the gates for settings.steps steps; a tqdm bar (on rank 0) shows the loss.

    With `checkpoint`, a run continues from that file when it exists and saves to it every SAVE_EVERY steps and
    when it stops. `time_limit` (seconds of training) stops it early, checkpoint saved, for machines that limit
    a command's time: the result then has fewer than settings.steps steps of history.
    """
    trainer = GateTrainer(model_dir, settings, rank=rank, world_size=world_size, device=device)
    done, history, wall_before = 0, [], 0.0
    if checkpoint is not None and Path(checkpoint).exists():
        done, history, wall_before = trainer.load(checkpoint)
    start = time.perf_counter()
    bar = tqdm(range(done, settings.steps), desc="identify", unit="step", initial=done, total=settings.steps,
               disable=not progress or rank != 0)
    for step in bar:
        stats = trainer.step(step)
        history.append(stats)
        done = step + 1
        bar.set_postfix(loss=f"{stats.loss:.4f}", distill=f"{stats.distill:.4f}", reg=f"{stats.reg:.4f}",
                        lr=f"{stats.lr:.1e}", gate=f"{stats.mean_gate:.3f}")
        # every process has the same time_limit, so only limited runs pay the per-step broadcast
        out_of_time = time_limit is not None and _agreed(time.perf_counter() - start >= time_limit, trainer)
        if checkpoint is not None and rank == 0 and (done % SAVE_EVERY == 0 or done == settings.steps or out_of_time):
            trainer.save(checkpoint, done, history, wall_before + time.perf_counter() - start)
        if out_of_time:
            break
    return TrainResult(gates=trainer.gate_matrix(), history=history,
                       wall_s=wall_before + time.perf_counter() - start, world_size=world_size,
                       device=str(trainer.device), dtype=str(trainer.dtype).split(".")[-1])


def _agreed(flag: bool, trainer: GateTrainer) -> bool:
    """Rank 0's flag on every process, so that all stop at the same step."""
    if trainer.world_size == 1:
        return flag
    import torch.distributed as dist

    shared = torch.tensor([flag], dtype=torch.int32, device=trainer.device)
    dist.broadcast(shared, 0)
    return bool(shared.item())


def build_pattern(model_dir: str | Path, settings: IdentifySettings, result: TrainResult, *, name: str | None = None,
                  aliases: Sequence[str] = (), sparsity: float = 0.5, deploy_sink: int = 64,
                  deploy_recent: int = 256, date: str | None = None, license: str | None = None) -> HeadPattern:
    """A HeadPattern with the trained gates, deploy defaults and a provenance that names every hyperparameter."""
    length = (f"{settings.context_len}" if settings.min_context_len in (None, settings.context_len)
              else f"uniform in [{settings.min_context_len}, {settings.context_len}]")
    method = (
        "DuoAttention gate optimization: one gate alpha per layer and KV head (init 1, broadcast over its GQA "
        "group), head output = alpha * causal attention + (1 - alpha) * streaming attention (Λ mask: sink "
        f"{settings.sink}, recent {settings.recent}); model frozen. Loss: mean over question/answer tokens of the "
        "squared distance (mean over the hidden size) between the final hidden states of the gated and the "
        f"full-attention model (distill) + reg_weight {settings.reg_weight} x mean |alpha|. AdamW lr {settings.lr}, "
        "weight decay 0, reference trapezoid schedule (linear warmup over the first 20% of steps, linear decay over "
        f"the last 20%, both floored at 0.1x), gates clamped to [0, 1] after every step; {settings.steps} steps, "
        f"{settings.batch_size} sample(s) per step and process x {result.world_size} process(es); data: "
        f"{settings.passkeys} 5-digit passkeys per prompt at random depths of varied filler sentences "
        f"(vllm_duo/scoring.py), prompt length {length} tokens, seed {settings.seed}; {result.dtype} on "
        f"{result.device}" + (", gradient checkpointing" if settings.grad_checkpoint else ""))
    final = result.history[-1]
    last = result.history[-max(1, len(result.history) // 10):]
    notes = (f"final loss {final.loss:.6f} (distill {final.distill:.6f}, reg {final.reg:.6f}); mean loss of the last "
             f"{len(last)} steps {np.mean([s.loss for s in last]):.6f}; first-step loss "
             f"{result.history[0].loss:.6f}; {len(result.history)} steps in {result.wall_s:.1f} s wall; mean gate "
             f"{result.gates.mean():.4f}. Deploy sink/recent {deploy_sink}/{deploy_recent} (the reference deploys "
             "64/256); training used the sink/recent in the method.")
    return HeadPattern.from_gates(result.gates, model_dir, name=name, aliases=aliases, sparsity=sparsity,
                                  sink=deploy_sink, recent=deploy_recent, source=SOURCE, method=method, notes=notes,
                                  date=date, license=license)


def _worker(rank: int, world_size: int, model_dir: str, settings: IdentifySettings, out: str, run: dict,
            options: dict, port: int) -> None:
    """One spawned process of a multi-process run; rank 0 writes the pattern."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    _run_distributed(model_dir, settings, out, run, options)


def _write_if_complete(model_dir: str, settings: IdentifySettings, result: TrainResult, out: str,
                       options: dict) -> None:
    if len(result.history) == settings.steps:
        build_pattern(model_dir, settings, result, **options).save(out)


def _run_distributed(model_dir: str, settings: IdentifySettings, out: str, run: dict, options: dict) -> None:
    """Runs one process of a torch.distributed job (torchrun or spawn): data parallel over samples."""
    import torch.distributed as dist

    rank, world_size, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    cuda = (settings.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    device = f"cuda:{local_rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    try:
        result = train(model_dir, settings, rank=rank, world_size=world_size, device=device, **run)
        if rank == 0:
            _write_if_complete(model_dir, settings, result, out, options)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def identify(model_dir: str | Path, out: str | Path, settings: IdentifySettings, *, processes: int | None = None,
             progress: bool = True, checkpoint: str | Path | None = None, time_limit: float | None = None,
             **options) -> str:
    """Trains the gates, writes the pattern JSON to `out` and returns a one-line summary.

    Under torchrun (WORLD_SIZE > 1) this process is one rank. Otherwise `processes` (default: the number of visible
    GPUs when training on CUDA, else 1) processes are spawned when it is above 1, each on its own GPU (gloo on CPU),
    data parallel over samples with the gate gradients all-reduced. `checkpoint` and `time_limit` are train()'s:
    a run stopped by the time limit writes no pattern, only the checkpoint. `options` go to build_pattern.
    """
    settings.check()
    model_dir, out = str(model_dir), str(out)
    if time_limit is not None and checkpoint is None:
        raise PatternError("a time limit needs a checkpoint (--checkpoint PATH): without one the stopped run's "
                           "training would be lost")
    run = {"checkpoint": None if checkpoint is None else str(checkpoint), "time_limit": time_limit}
    read_hf_config(model_dir)  # a wrong folder fails here, not in every spawned process
    cuda = (settings.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _run_distributed(model_dir, settings, out, run, options)
        if int(os.environ["RANK"]) != 0:
            return ""
    else:
        processes = processes or (torch.cuda.device_count() if cuda else 1)
        if processes > 1:
            import torch.multiprocessing as mp

            mp.spawn(_worker, args=(processes, model_dir, settings, out, run, options, _free_port()),
                     nprocs=processes)
        else:
            _write_if_complete(model_dir, settings, train(model_dir, settings, progress=progress, **run), out,
                               options)
    if checkpoint is not None and (done := checkpoint_steps(checkpoint)) < settings.steps:
        return (f"stopped at step {done} of {settings.steps} (time limit); state saved in {checkpoint}: run the "
                "same command again to continue")
    pattern = HeadPattern.load(out)
    counts = pattern.retrieval_counts()
    return (f"wrote {out}: {pattern.model.num_layers} layers x {pattern.model.num_kv_heads} KV heads, "
            f"{sum(counts)} retrieval at sparsity {pattern.sparsity:g}; {pattern.provenance.notes}")
