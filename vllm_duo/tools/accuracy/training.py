# SPDX-License-Identifier: Apache-2.0
"""DuoAttention gate training: one gate per layer and KV head (or per layer, ZigzagAttention's layer-wise alphas)
mixes full and streaming attention in the frozen Hugging Face model, trained so that the mix keeps the full model's
hidden states on multi-passkey prompts.

Haystack: the varied filler sentences of passkey.py (subject, verb, object and ending drawn from fixed lists,
12^4 sentences, no digits), generated offline from a seed. The reference trains on BookSum chapters, which are not
available offline; digit-free sentences keep the passkeys the only numbers in the prompt, so the question tokens can
only be answered from the needles. With `repeated`, that share of prompts repeats one short paragraph of such
sentences instead: the classic passkey test's kind of haystack ("The grass is green. ..." repeated), where every
token has an exact copy one period back for copy heads to latch onto, and where gates trained on varied text alone
stream heads the model needs.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

from vllm_duo.pattern import HeadPattern, PatternError, read_hf_config, resolve_pattern
from vllm_duo.tools.accuracy.passkey import ORDINALS, PasskeySample, multi_passkey_prompt

SAVE_EVERY = 50  # steps between checkpoint writes, when a checkpoint path is given
# Prompt lengths are drawn from this many evenly spaced values in [min, max]: the paper's "50 intervals ranging
# from 1,000 tokens to the model-specific maximum length".
LENGTH_INTERVALS = 50
_ATTENTION = "duo_gated"
# Sentences of a repeated-haystack prompt's paragraph, drawn uniformly (the classic passkey paragraph has five).
REPEATED_PERIOD = (3, 8)


@dataclass(frozen=True)
class IdentifySettings:
    """Hyperparameters of one gate-training run; defaults are the reference's (lr 0.02, reg 0.05, 2000 steps).

    sink 64 / recent 256 is what is deployed: the paper trains with sink 128 but serves 64, so heads were chosen
    for a window other than the one they get (issue 20); here the trained window is the served one by default.
    """

    steps: int = 2000
    context_len: int = 8192
    min_context_len: int | None = None  # None: every sample has context_len tokens
    batch_size: int = 1  # samples per step and process
    lr: float = 0.02
    reg_weight: float = 0.05
    sink: int = 64
    recent: int = 256
    passkeys: int = 10
    repeated: float = 0.0  # the share of prompts whose haystack is one short paragraph repeated
    seed: int = 42
    dtype: str | None = None  # None: bfloat16 on CUDA, float32 on CPU
    grad_checkpoint: bool = False
    layer_gates: bool = False  # one gate per layer shared by its KV heads (ZigzagAttention's layer-wise alphas)
    # Train the mask served at this sparsity: each gate's hard value there in the forward pass, no L1 term.
    target_sparsity: float | None = None
    init_pattern: str | None = None  # start from this pattern's gates (a file or bundled name), not from 1
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
        if not 0.0 <= self.repeated <= 1.0:
            problems.append("the repeated-haystack share must be in [0, 1]")
        if self.lr <= 0 or self.reg_weight < 0:
            problems.append("lr must be positive and reg weight non-negative")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            problems.append(f"dtype {self.dtype} is not float32, bfloat16 or float16")
        if self.target_sparsity is not None and not 0.0 < self.target_sparsity < 1.0:  # also rejects NaN
            problems.append(f"target sparsity {self.target_sparsity} must be in (0, 1), e.g. 0.25")
        if self.target_sparsity is not None and self.layer_gates:
            problems.append("a target sparsity trains a mask of single KV heads, layer gates one gate per layer: drop "
                            "--layer-gates (for a layer-exclusive pattern run `vllm-duo pattern zigzag` on the result)")
        if self.init_pattern is not None and self.target_sparsity is None:
            problems.append("an initial pattern is fine-tuned for a target sparsity: add --target-sparsity")
        if problems:
            raise PatternError("; ".join(problems))



class _Mixing:
    """Passed through the model's forward kwargs: tells the attention function to mix full and streaming outputs.

    The streaming (Λ-masked) attention runs in query blocks of `block` tokens, each over its own keys: the sink and
    the `recent` tokens before the block plus the block itself. That costs O(T x (sink + recent + block)) where a
    dense T x T mask costs O(T^2). block = recent rounded up to a multiple of 16: the work per query is then at most
    twice the sink + recent it needs, and the gathered keys at most (2 + sink / recent) copies of K and V, where a
    smaller block would gather more copies and a larger one waste more work on masked keys.
    """

    def __init__(self, sink: int, recent: int):
        self.sink, self.recent = sink, recent
        self.block = _round_up(recent, 16)
        self._layouts: dict[tuple[int, str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.hard_gates: torch.Tensor | None = None  # [layers, KV heads] 0/1 with a target sparsity

    def gate(self, module) -> torch.Tensor:
        """The gate of `module`'s mix: its trained gate, or with hard_gates set its hard value with a straight-through
        gradient, so the loss is the deployed mask's and the gradient still reaches the soft gate."""
        soft = module.duo_gate
        if self.hard_gates is None:
            return soft
        # (soft - soft.detach()) is exactly 0, so the forward value is exactly the hard gate
        return self.hard_gates[module.layer_idx] + (soft - soft.detach())

    def layout(self, length: int, device: torch.device,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(key positions [num_blocks * width], additive mask [num_blocks, 1, block, width] of 0 and -inf) of the
        query blocks; built once per length, device and dtype. Additive, not bool: SDPA would otherwise turn a bool
        mask into this one on every call, over all heads.

        A block's width key slots are the sink positions [0, sink) then the window [start - recent, start + block),
        padded to a multiple of 16 (the memory-efficient GPU kernel's alignment). The mask keeps exactly the Λ rule,
        key k visible to query q iff k <= q and (k < sink or k > q - recent): slots out of [0, T), padding, and
        window slots below sink (already in the sink part) are masked, and their positions clamped into [0, T).
        Padding queries (beyond T, cut off afterwards) see every real key of their block, so that no row is empty.
        """
        cache_key = (length, str(device), dtype)
        if cache_key not in self._layouts:
            block, num_blocks = self.block, -(-length // self.block)
            sink_slots = _round_up(self.sink + self.recent, 16) - self.recent  # sink positions, then padding
            slot = torch.arange(sink_slots + self.recent + block, device=device)
            starts = torch.arange(num_blocks, device=device)[:, None] * block
            window = slot >= sink_slots
            keys = torch.where(window, starts - self.recent - sink_slots + slot, slot)  # [num_blocks, width]
            real = torch.where(window, keys >= self.sink, keys < self.sink) & (keys < length)
            q = (starts + torch.arange(block, device=device))[:, :, None]  # [num_blocks, block, 1]
            k = keys[:, None, :]
            visible = (k <= q) & ((k < self.sink) | (k > q - self.recent))
            hidden = ~(real[:, None, :] & (visible | (q >= length)))
            mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
            self._layouts[cache_key] = (keys.clamp(0, length - 1).flatten(), mask[:, None])
        return self._layouts[cache_key]

    def streaming(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
        """Λ-masked attention of [batch, heads, T, head_dim] query/key/value (same head count), one SDPA call over
        all query blocks; equal to SDPA with the dense [T, T] Λ mask."""
        batch, heads, length, head_dim = query.shape
        index, mask = self.layout(length, query.device, query.dtype)
        num_blocks, _, block, width = mask.shape
        # blocks become the batch dimension: [batch * num_blocks, heads, block or width, head_dim] views
        blocks = F.pad(query, (0, 0, 0, num_blocks * block - length))
        blocks = blocks.view(batch, heads, num_blocks, block, head_dim).transpose(1, 2).flatten(0, 1)
        keys, values = (t.index_select(2, index).view(batch, heads, num_blocks, width, head_dim).transpose(1, 2)
                        .flatten(0, 1) for t in (key, value))
        mask = mask.expand(batch, num_blocks, heads, block, width).flatten(0, 1)  # a view when batch is 1
        out = F.scaled_dot_product_attention(blocks, keys, values, attn_mask=mask, scale=scale)
        return out.unflatten(0, (batch, num_blocks)).transpose(1, 2).flatten(2, 3)[:, :, :length]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def gated_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, duo_mix=None, **kwargs):
    """alpha * causal + (1 - alpha) * Λ-masked attention per KV head, alpha = `module.duo_gate` (GQA-broadcast;
    one value for the whole layer when it holds a single gate).

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
        streaming = duo_mix.streaming(query, key, value, scaling)
        gate = duo_mix.gate(module).to(query.dtype).expand(num_heads // groups).repeat_interleave(groups)
        gate = gate.view(1, num_heads, 1, 1)
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
    """The frozen model with one trainable gate per KV head and layer (per layer with layer_gates), and the AdamW
    step over those gates."""

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
        gates_per_layer = 1 if settings.layer_gates else self.num_kv_heads
        initial = (np.ones((self.num_layers, gates_per_layer)) if settings.init_pattern is None
                   else initial_pattern(settings, model_dir).gates)
        for layer in range(self.num_layers):
            gate = torch.nn.Parameter(torch.tensor(initial[layer], device=self.device, dtype=torch.float32))
            attention[layer].duo_gate = gate  # a registered Parameter of the module, float32 whatever the model dtype
            self.gates.append(gate)
        # weight_decay 0 as in the reference: the L1 term is the only pull on the gates (none with a target sparsity,
        # where only their ranking matters).
        self.optimizer = torch.optim.AdamW(self.gates, lr=settings.lr, weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda step: lr_factor(step, settings.steps))
        self.mixing = _Mixing(settings.sink, settings.recent)

    def sample(self, index: int) -> PasskeySample:
        """The index-th training prompt of the run; depends only on the seed and index, not on the process count."""
        rng = random.Random(f"{self.settings.seed}/{index}")
        low = self.settings.min_context_len or self.settings.context_len
        length = int(rng.choice(np.linspace(low, self.settings.context_len, LENGTH_INTERVALS).round()))
        period = rng.randint(*REPEATED_PERIOD) if rng.random() < self.settings.repeated else None
        return multi_passkey_prompt(self.tokenizer, length, rng, self.settings.passkeys, sink=self.settings.sink,
                                    recent=self.settings.recent, period=period)

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
        """One AdamW step on batch_size samples per process; gate gradients averaged over processes."""
        settings = self.settings
        self.optimizer.zero_grad(set_to_none=True)
        self.mixing.hard_gates = self.hard_gates()
        distill = 0.0
        for i in range(settings.batch_size):
            sample = self.sample((step * self.world_size + self.rank) * settings.batch_size + i)
            loss = self.distill_loss(sample) / settings.batch_size
            loss.backward()  # one sample at a time: the activations of one long prompt are what memory holds
            distill += loss.item()
        reg_value = 0.0  # with a target sparsity: no L1 term, the sparsity fixes the number of streaming heads
        if settings.target_sparsity is None:
            # L1 of the gates as their mean, so lambda means the same for any head count (the paper writes a sum;
            # the reference's loss.py was not available to check). Added on every process: the average below keeps
            # it once.
            reg = settings.reg_weight * torch.cat(list(self.gates)).abs().mean()
            reg.backward()
            reg_value = reg.item()
        stats = torch.tensor([distill, reg_value], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            import torch.distributed as dist

            grads = torch.stack([gate.grad for gate in self.gates])
            dist.all_reduce(grads)
            grads /= self.world_size
            for gate, grad in zip(self.gates, grads):
                gate.grad.copy_(grad)
            dist.all_reduce(stats)
            stats /= self.world_size
        if settings.target_sparsity is not None:
            # Only the ranking matters: without this, every gate's gradient says "more full attention helps", Adam
            # moves each by about lr per step whatever its size, and all climb alike. Centered, a gate rises when
            # making its head full helps more than the average head's, and falls when less.
            mean_grad = torch.cat([gate.grad for gate in self.gates]).mean()
            for gate in self.gates:
                gate.grad.sub_(mean_grad)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        if settings.target_sparsity is None:  # a ranking is not clamped: ties at 0 or 1 would leave the mask undefined
            with torch.no_grad():
                for gate in self.gates:
                    gate.clamp_(0.0, 1.0)
        distill, reg_value = stats.tolist()
        return StepStats(loss=distill + reg_value, distill=distill, reg=reg_value, lr=lr,
                         mean_gate=float(torch.cat([g.detach() for g in self.gates]).mean()))

    def hard_gates(self) -> torch.Tensor | None:
        """[layers, KV heads] 1 (retrieval) / 0 (streaming) of the mask the current gates give at the target sparsity,
        binarized as served (HeadPattern._binarize); None without a target sparsity."""
        if self.settings.target_sparsity is None:
            return None
        mask = HeadPattern._binarize(self.gate_matrix(), self.settings.target_sparsity)
        return torch.from_numpy(mask).to(self.device, torch.float32)

    def gate_matrix(self) -> np.ndarray:
        """Float64 [num_layers, num_kv_heads] copy of the gates (a layer gate repeated over its KV heads)."""
        rows = [gate.detach().float().cpu().expand(self.num_kv_heads) for gate in self.gates]
        return torch.stack(rows).double().numpy()

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


def initial_pattern(settings: IdentifySettings, model_dir: str | Path) -> HeadPattern:
    """The pattern a fine-tune starts from (found as a served one is: file, bundled name, reference folder), checked
    to have gates for this model and the training window: its mask is trained for the window it is served with."""
    pattern, source = resolve_pattern(settings.init_pattern)
    pattern.check_model(*read_hf_config(model_dir), model_name=str(model_dir))
    if pattern.gates is None or pattern.retrieval_mask is not None:
        raise PatternError(f"the initial pattern ({source}) has no gates or fixes a retrieval_mask: start from a "
                           "pattern with gates and no retrieval_mask (e.g. the one a zigzag pattern was made from)")
    if (settings.sink, settings.recent) != (pattern.sink, pattern.recent):
        raise PatternError(f"sink/recent {settings.sink}/{settings.recent} differ from the initial pattern's "
                           f"{pattern.sink}/{pattern.recent} ({source}): a mask is trained for the window it is served "
                           "with; leave --sink and --recent unset to take the pattern's")
    return pattern


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
