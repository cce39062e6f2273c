# SPDX-License-Identifier: Apache-2.0
"""Head-pattern files: which KV heads keep the full cache (retrieval) and which keep only sink + recent (streaming)."""
from __future__ import annotations

import datetime
import importlib.resources
import json
import math
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, PrivateAttr, ValidationError
from pydantic import field_validator, model_validator

SCHEMA_VERSION = 1
PATTERN_FILE_IN_MODEL_DIR = "duo_pattern.json"
REFERENCE_GATES_FILE = "full_attention_heads.tsv"
REFERENCE_CONFIG_FILE = "config.json"
REFERENCE_METHOD = "DuoAttention gate optimization (reference training run)"
# Training leaves gates a hair below 0 (as low as -1.4e-3) because it clamps before each step, not after the last.
GATE_TOLERANCE = 0.01
# s * (N - 1) is computed in floating point; 0.7 * 10 == 7.000000000000001 must still count as 7 streaming heads.
_CEIL_EPSILON = 1e-9
_FIX_MODEL = "use the pattern made for this model or run `vllm-duo identify`"


class PatternError(ValueError):
    """A user error about a head pattern; the message is one line that names the problem and the fix."""


class AttentionShape(NamedTuple):
    """The attention shape a pattern must match; read from a Hugging Face config.json."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


# What each field of a pattern file holds, for the messages about a hand-edited one; `gates[0][1]` is under "gates".
FIELD_VALUES = {
    "schema_version": f"{SCHEMA_VERSION}",
    "model": "an object with name, aliases, architecture, num_layers, num_kv_heads and head_dim",
    "model.name": 'a non-empty string (e.g. "Llama-3.1-8B-Instruct")',
    "model.aliases": 'a list of strings (e.g. ["meta-llama/Llama-3.1-8B-Instruct"])',
    "model.architecture": 'a non-empty string (e.g. "LlamaForCausalLM")',
    "model.num_layers": "a positive integer, the model's num_hidden_layers",
    "model.num_kv_heads": "a positive integer, the model's num_key_value_heads",
    "model.head_dim": "a positive integer (e.g. 128)",
    "gates": "a list of rows, one per layer, of one number in [0, 1] per KV head (or null with a retrieval_mask)",
    "retrieval_mask": "a list of rows, one per layer, of one 0 (streaming) or 1 (retrieval) per KV head (or null)",
    "masks": 'an object from a sparsity (e.g. "0.25") to the retrieval mask trained for it, rows of 0 or 1 (or null)',
    "sparsity": "a number in [0, 1], the fraction of streaming heads (e.g. 0.5)",
    "sink": "a whole number of tokens, 0 or more (e.g. 64)",
    "recent": "a whole number of tokens, 0 or more (e.g. 256)",
    "layer_exclusive": "true or false",
    "provenance": "an object with source, method, date, license and notes",
    "provenance.source": "a string, where the gates come from",
    "provenance.method": "a string, how the gates were made",
    "provenance.date": 'a string (e.g. "2025-01-31")',
    "provenance.license": "a string or null",
    "provenance.notes": "a string or null",
}
_PATTERN_OBJECT = ("a pattern is a JSON object with the fields "
                   + ", ".join(field for field in FIELD_VALUES if "." not in field))


class _StrictModel(BaseModel):
    # Unknown keys are typos or files from a newer schema, and a quoted "0.5" is a mistake: reject both rather than
    # guess. Frozen: one loaded pattern is shared by every layer of the model.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelInfo(_StrictModel):
    """The model a pattern was learned on; `aliases` let a Hugging Face repo id or folder name find it."""

    name: str = Field(min_length=1)
    aliases: list[str] = []
    architecture: str = Field(min_length=1)
    num_layers: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt


class Provenance(_StrictModel):
    """Where the gates come from, so a served pattern can be traced back to its training run and license."""

    source: str
    method: str
    date: str
    license: str | None = None
    notes: str | None = None


class HeadPattern(_StrictModel):
    """A DuoAttention head pattern (schema_version 1).

    `gates[l][h]` is the learned gate of KV head h in layer l (higher = matters more for long-range retrieval);
    keeping the gates lets any sparsity be chosen at serve time. `retrieval_mask[l][h]` (1 = retrieval) fixes one
    choice instead. `masks["0.25"]` is a retrieval mask fine-tuned for sparsity 0.25 (`vllm-duo identify
    --target-sparsity`): a gate ranking trained once is not the best mask at every sparsity. `sparsity` is the
    default fraction of streaming heads; for a mask-only pattern it is implied by the mask. Streaming heads keep
    the first `sink` and the last `recent` tokens. `layer_exclusive` is carried for the serving backend and does
    not change binarization here.
    """

    schema_version: Literal[1]
    model: ModelInfo
    gates: list[list[float]] | None = None
    retrieval_mask: list[list[int]] | None = None
    masks: dict[str, list[list[int]]] | None = None
    sparsity: float | None = Field(default=None, ge=0.0, le=1.0)
    sink: NonNegativeInt
    recent: NonNegativeInt
    layer_exclusive: bool = False
    provenance: Provenance
    _origin: str | None = PrivateAttr(default=None)

    @field_validator("gates")
    @classmethod
    def _check_and_clip_gates(cls, gates: list[list[float]] | None) -> list[list[float]] | None:
        if gates is None:
            return None
        for layer, row in enumerate(gates):
            for head, gate in enumerate(row):
                if not (-GATE_TOLERANCE <= gate <= 1.0 + GATE_TOLERANCE):  # also rejects NaN
                    raise ValueError(f"gates[{layer}][{head}] = {gate} is not a gate in [0, 1]")
        return [[min(max(gate, 0.0), 1.0) for gate in row] for row in gates]

    @field_validator("retrieval_mask")
    @classmethod
    def _check_mask_values(cls, mask: list[list[int]] | None) -> list[list[int]] | None:
        _check_zeros_and_ones("retrieval_mask", mask)
        return mask

    @field_validator("masks")
    @classmethod
    def _check_masks_keys_and_values(cls, masks: dict[str, list[list[int]]] | None) -> dict | None:
        for key, mask in (masks or {}).items():
            try:
                sparsity = float(key)
            except ValueError:
                sparsity = math.nan
            if not 0.0 <= sparsity <= 1.0:  # also rejects NaN
                raise ValueError(f'masks key "{key}" is not a sparsity: key each mask by its sparsity in [0, 1], '
                                 'e.g. "0.25"')
            _check_zeros_and_ones(f'masks["{key}"]', mask)
        return masks

    @model_validator(mode="after")
    def _check_consistency(self) -> HeadPattern:
        if self.gates is None and self.retrieval_mask is None:
            raise ValueError("neither `gates` nor `retrieval_mask` is given; a pattern needs at least one")
        for field in ("gates", "retrieval_mask"):
            self._check_matrix_shape(field, getattr(self, field))
        self._check_masks()
        if self.sink == 0 and self.recent == 0:
            raise ValueError("`sink` and `recent` are both 0, so streaming heads would see no tokens: set either "
                             "above 0 (e.g. sink 64, recent 256)")
        if self.retrieval_mask is None and self.sparsity is None:
            raise ValueError("`sparsity` is missing; a pattern with gates needs a default: add `sparsity`, "
                             f"{FIELD_VALUES['sparsity']}")
        if self.retrieval_mask is not None and self.sparsity is not None and not self._sparsity_matches_mask(
                self.sparsity):
            raise ValueError(
                f"`sparsity` {self.sparsity} contradicts retrieval_mask (sparsity {self._mask_sparsity():.4f}): set "
                "`sparsity` to the mask's or remove it")
        return self

    def _check_masks(self) -> None:
        """Each stored mask has its key's number of streaming heads, and no two masks answer one sparsity."""
        answered = {}
        if self.retrieval_mask is not None:
            answered[self._num_streaming_in(self.retrieval_mask)] = "retrieval_mask"
        for key, mask in (self.masks or {}).items():
            field = f'masks["{key}"]'
            self._check_matrix_shape(field, mask)
            streaming, selected = self._num_streaming_in(mask), self._num_streaming(self.num_heads, float(key))
            if streaming != selected:
                raise ValueError(f"{field} has {streaming} streaming heads but sparsity {key} selects {selected} of "
                                 f"{self.num_heads}: key the mask by its own sparsity or fix it")
            if streaming in answered:
                raise ValueError(f"{field} and {answered[streaming]} both have {streaming} streaming heads: keep one")
            answered[streaming] = field

    def _check_matrix_shape(self, field: str, matrix: list[list] | None) -> None:
        if matrix is None:
            return
        if len(matrix) != self.model.num_layers:
            raise ValueError(f"`{field}` has {len(matrix)} rows but model.num_layers is {self.model.num_layers}: "
                             "give one row per layer")
        for layer, row in enumerate(matrix):
            if len(row) != self.model.num_kv_heads:
                raise ValueError(f"{field}[{layer}] has {len(row)} entries but model.num_kv_heads is "
                                 f"{self.model.num_kv_heads}: give one entry per KV head")

    @property
    def label(self) -> str:
        """How messages name this pattern: its file when it came from one, else its model."""
        return f"pattern {self._origin or self.model.name}"

    @property
    def num_heads(self) -> int:
        """N = layers x KV heads, the population the sparsity is a fraction of."""
        return self.model.num_layers * self.model.num_kv_heads

    @classmethod
    def load(cls, path: str | Path) -> HeadPattern:
        """Reads and validates a pattern JSON file; every problem becomes a one-line PatternError that says what to
        change: in a hand-edited file, the field and what it holds; a reference file is converted instead."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise PatternError(f"cannot read pattern {path}: {error.strerror or error}: check the path") from None
        folder = path.parent
        if path.name in (REFERENCE_GATES_FILE, REFERENCE_CONFIG_FILE) and (folder / REFERENCE_GATES_FILE).is_file():
            raise PatternError(
                f"{path} is a file of the duo-attention reference folder {folder}, not a pattern JSON: pass the "
                f"folder, or convert it once with `vllm-duo pattern convert {folder} -o pattern.json`")
        if not text.strip():
            raise PatternError(f"pattern {path} is empty: {_PATTERN_OBJECT}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PatternError(f"pattern {path} is not JSON ({error}): fix the JSON syntax there") from None
        return cls._validated(data, origin=str(path))

    @classmethod
    def _validated(cls, data: object, origin: str) -> HeadPattern:
        try:
            pattern = cls.model_validate(data)
        except ValidationError as error:
            raise PatternError(f"pattern {origin}: {_first_problem(error)}") from None
        pattern._origin = origin
        return pattern


    def save(self, path: str | Path) -> None:
        """Writes the pattern as JSON with one matrix row per line, so diffs and reviews stay readable."""
        members = []
        for key, value in self.model_dump(mode="json", exclude_none=True).items():
            if key in ("gates", "retrieval_mask"):
                members.append(f'  "{key}": {_rows_json(value, "  ")}')
            elif key == "masks":
                masks = ",\n".join(f'    "{sparsity}": {_rows_json(mask, "    ")}' for sparsity, mask in value.items())
                members.append(f'  "{key}": {{\n{masks}\n  }}')
            else:
                members.append(f'  "{key}": ' + json.dumps(value, indent=2).replace("\n", "\n  "))
        Path(path).write_text("{\n" + ",\n".join(members) + "\n}\n", encoding="utf-8")

    def retrieval_mask_at(self, sparsity: float | None = None) -> np.ndarray:
        """Bool [num_layers, num_kv_heads] mask, True = retrieval head, at `sparsity` (default: the pattern's).

        Follows the reference binarization (duo_attn/utils.py sparsify_attention_heads): one global quantile
        threshold, so N - ceil(s * (N - 1)) of the N heads are retrieval, taken in decreasing gate order; s = 1
        gives none, s = 0 all. The reference breaks ties with random noise; here ties go to the lower layer, then
        the lower head, so the same call always gives the same mask. A stored mask is returned as is: the
        retrieval_mask, or the mask of `masks` trained for this sparsity (trained_mask_key); it is an error to ask a
        mask-only pattern for another sparsity.
        """
        if sparsity is not None and not 0.0 <= sparsity <= 1.0:  # also rejects NaN
            raise PatternError(f"sparsity {sparsity} is outside [0, 1]: pass the fraction of streaming heads, e.g. 0.5")
        if self.retrieval_mask is not None and (sparsity is None or self._sparsity_matches_mask(sparsity)):
            return np.array(self.retrieval_mask, dtype=bool)
        trained = self.trained_mask_key(sparsity)
        if trained is not None:
            return np.array(self.masks[trained], dtype=bool)
        if self.gates is None:
            raise PatternError(
                f"{self.label} stores only a retrieval mask (sparsity {self._mask_sparsity():.4f}), not gates, so "
                f"sparsity {sparsity} cannot be chosen: leave sparsity unset or use a pattern with gates")
        return self._binarize(np.array(self.gates), self.sparsity if sparsity is None else sparsity)

    def trained_mask_key(self, sparsity: float | None = None) -> str | None:
        """The key of the stored mask of `masks` that `sparsity` (default: the pattern's) selects: the one with as
        many streaming heads as the gates would give; None when there is none."""
        sparsity = self.sparsity if sparsity is None else sparsity
        if sparsity is None:
            return None
        wanted = self._num_streaming(self.num_heads, sparsity)
        return next((key for key, mask in (self.masks or {}).items() if self._num_streaming_in(mask) == wanted), None)

    def retrieval_counts(self, sparsity: float | None = None) -> list[int]:
        """Number of retrieval KV heads in each layer; what the KV cache layout of each layer depends on."""
        return self.retrieval_mask_at(sparsity).sum(axis=1).tolist()

    def check_model(self, architecture: str, num_layers: int, num_kv_heads: int, head_dim: int,
                    *, model_name: str | None = None) -> None:
        """Raises PatternError unless the model has this pattern's layers, KV heads and head_dim.

        The architecture is named in the message but not compared: fine-tunes and renamed classes (e.g.
        MistralForCausalLM vs LlamaForCausalLM) share one attention layout, and the shape is what the KV cache
        and the gates are indexed by.
        """
        expected = (self.model.num_layers, self.model.num_kv_heads, self.model.head_dim)
        if expected == (num_layers, num_kv_heads, head_dim):
            return
        model = f"model {model_name} ({architecture})" if model_name else f"model {architecture}"
        raise PatternError(
            f"{self.label} has {expected[0]} layers x {expected[1]} KV heads x head_dim {expected[2]} but {model} "
            f"has {num_layers} x {num_kv_heads} x {head_dim}: {_FIX_MODEL}")

    def _mask_sparsity(self) -> float:
        return 1.0 - float(np.mean(self.retrieval_mask))

    def _sparsity_matches_mask(self, sparsity: float) -> bool:
        """True when `sparsity` selects the mask's number of streaming heads (so 0.33 matches 1 of 3)."""
        return self._num_streaming(self.num_heads, sparsity) == self._num_streaming_in(self.retrieval_mask)

    @staticmethod
    def _num_streaming_in(mask: list[list[int]]) -> int:
        return sum(row.count(0) for row in mask)

    @staticmethod
    def _num_streaming(num_heads: int, sparsity: float) -> int:
        """Streaming heads of N at `sparsity` by the reference rule: ceil(s * (N - 1)), all N at s = 1."""
        return math.ceil(sparsity * (num_heads - 1) - _CEIL_EPSILON) if sparsity < 1.0 else num_heads

    @staticmethod
    def _binarize(gates: np.ndarray, sparsity: float) -> np.ndarray:
        num_heads = gates.size
        num_streaming = HeadPattern._num_streaming(num_heads, sparsity)
        flat = gates.ravel()
        # lexsort's last key is the primary one: gates descending, then flat index (layer-major) ascending.
        by_importance = np.lexsort((np.arange(num_heads), -flat))
        mask = np.zeros(num_heads, dtype=bool)
        mask[by_importance[: num_heads - num_streaming]] = True
        return mask.reshape(gates.shape)


def _check_zeros_and_ones(field: str, mask: list[list[int]] | None) -> None:
    for layer, row in enumerate(mask or []):
        for head, value in enumerate(row):
            if value not in (0, 1):
                raise ValueError(f"{field}[{layer}][{head}] = {value} is not 0 or 1")


def _rows_json(matrix: list[list], indent: str) -> str:
    """A JSON matrix with one row per line, indented under its key."""
    rows = ",\n".join(f"{indent}  {json.dumps(row)}" for row in matrix)
    return f"[\n{rows}\n{indent}]"


def ideal_kv_slots(context_len: int, num_retrieval: int, num_streaming: int, sink: int, recent: int) -> int:
    """(token, KV head) slots of one request's KV cache without paging, each holding K and V of one token: every
    token in each retrieval head, the first `sink` and last `recent` in each streaming head (a request shorter than
    sink + recent: its tokens). The ideal figure of `vllm-duo patterns show` and of the server's startup line
    (DuoPlan.capacity_ratio); kv_cache.py's pages round it up to whole blocks."""
    return context_len * num_retrieval + min(context_len, sink + recent) * num_streaming



def read_hf_config(model: str | Path) -> AttentionShape:
    """Attention shape from a Hugging Face config.json (or the model folder holding it)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    config = _read_json_object(path)
    try:
        num_attention_heads = config["num_attention_heads"]
        shape = AttentionShape(
            architecture=config["architectures"][0],
            num_layers=config["num_hidden_layers"],
            num_kv_heads=config.get("num_key_value_heads") or num_attention_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_attention_heads,
        )
    except (KeyError, IndexError, TypeError) as error:
        raise PatternError(f"model config {path} lacks {error}: point at a Hugging Face model folder") from None
    return shape


def pattern_from_reference_dir(
    folder: str | Path,
    name: str | None = None,
    *,
    model_config: str | Path | None = None,
    architecture: str | None = None,
    head_dim: int | None = None,
    aliases: list[str] | tuple[str, ...] = (),
    sink: int = 64,
    recent: int = 256,
    sparsity: float = 0.5,
    source: str | None = None,
    date: str | None = None,
    license: str | None = None,
) -> HeadPattern:
    """Imports a mit-han-lab/duo-attention pattern folder (full_attention_heads.tsv + training config.json).

    The gates are kept (clipped to [0, 1], as the reference loader does) so any sparsity can be chosen later.
    sink/recent default to 64/256, what the reference deploys for LongBench and NIAH; the training values
    from config.json (128/256) go to the provenance notes. The folder holds neither the architecture nor
    head_dim: they come from explicit arguments, else from `model_config` (a Hugging Face config.json or its
    folder), else from the bundled pattern of the same name. `source` defaults to the training run's
    output_dir, `date` to the TSV's modification date.
    """
    folder = Path(folder)
    name = name or folder.resolve().name
    gates_file = folder / REFERENCE_GATES_FILE
    if not gates_file.is_file():
        raise PatternError(f"{folder} has no {REFERENCE_GATES_FILE}: point at a duo-attention attn_patterns run")
    try:
        gates = np.loadtxt(gates_file, delimiter="\t", ndmin=2)
    except ValueError as error:
        raise PatternError(f"{gates_file} is not a tab-separated float matrix ({error}): re-export it") from None
    training = _read_json_object(folder / REFERENCE_CONFIG_FILE)
    num_layers, num_kv_heads = gates.shape

    if model_config is not None:
        shape = read_hf_config(model_config)
        architecture = architecture or shape.architecture
        head_dim = head_dim or shape.head_dim
        if (shape.num_layers, shape.num_kv_heads) != (num_layers, num_kv_heads):
            raise PatternError(
                f"{gates_file} is {num_layers} layers x {num_kv_heads} KV heads but model config {model_config} "
                f"has {shape.num_layers} x {shape.num_kv_heads}: {_FIX_MODEL}")
    if architecture is None or head_dim is None:
        known = find_bundled(name)
        if known is not None:
            known_model = HeadPattern.load(known).model
            architecture = architecture or known_model.architecture
            head_dim = head_dim or known_model.head_dim
    if architecture is None or head_dim is None:
        raise PatternError(
            f"{folder} does not say the model's architecture and head_dim: pass the model's config.json (CLI: --model) "
            "or, to convert, --architecture and --head-dim")

    data = {
        "schema_version": SCHEMA_VERSION,
        "model": {"name": name, "aliases": list(aliases), "architecture": architecture,
                  "num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim},
        "gates": gates.tolist(),
        "sparsity": sparsity,
        "sink": sink,
        "recent": recent,
        "provenance": {
            "source": source or str(training.get("output_dir") or folder),
            "method": REFERENCE_METHOD,
            "date": date or datetime.date.fromtimestamp(gates_file.stat().st_mtime).isoformat(),
            "license": license,
            "notes": _training_notes(training, sink, recent),
        },
    }
    return HeadPattern._validated(data, origin=str(folder))




def _bundled_dir() -> Path:
    """Installed, patterns/ is the package `vllm_duo.patterns`; in a source checkout it sits beside vllm_duo/."""
    try:
        return Path(str(importlib.resources.files("vllm_duo.patterns")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "patterns"


def bundled_patterns() -> dict[str, Path]:
    """Pattern files shipped with vllm-duo, by name (file name without .json)."""
    return {path.stem: path for path in sorted(_bundled_dir().glob("*.json"))}


def find_bundled(name_or_alias: str) -> Path | None:
    """The bundled pattern whose file name, model name or alias equals `name_or_alias` (case-insensitive)."""
    wanted = name_or_alias.casefold()
    for stem, path in bundled_patterns().items():
        model = HeadPattern.load(path).model
        if wanted in {name.casefold() for name in (stem, model.name, *model.aliases)}:
            return path
    return None


def resolve_pattern(spec: str | None, model_path: str | None = None) -> tuple[HeadPattern, str]:
    """Finds the pattern to serve `model_path` with; returns it and a description of where it came from.

    With `spec`: an existing file is loaded, a folder with full_attention_heads.tsv is imported, else `spec` is
    a bundled name or alias. Without: `<model_path>/duo_pattern.json`, else the bundled pattern named like the
    model (the full id, then its last path component).
    """
    if spec is not None:
        candidate = Path(spec).expanduser()
        if candidate.is_file():
            return HeadPattern.load(candidate), f"file {candidate}"
        if (candidate / REFERENCE_GATES_FILE).is_file():
            model_config = Path(model_path) / "config.json" if model_path else None
            pattern = pattern_from_reference_dir(
                candidate, model_config=model_config if model_config and model_config.is_file() else None)
            return pattern, f"reference folder {candidate}"
        bundled = find_bundled(spec)
        if bundled is not None:
            return HeadPattern.load(bundled), f"bundled pattern {bundled.stem}"
        raise PatternError(
            f"no head pattern {spec!r}: pass a pattern JSON file, a reference folder with {REFERENCE_GATES_FILE}, "
            f"or a bundled name ({_bundled_names()})")

    if model_path:
        in_model_dir = Path(model_path).expanduser() / PATTERN_FILE_IN_MODEL_DIR
        if in_model_dir.is_file():
            return HeadPattern.load(in_model_dir), f"file {in_model_dir} in the model folder"
        model_id = model_path.rstrip("/")
        for key in dict.fromkeys((model_id, Path(model_id).name)):
            bundled = find_bundled(key)
            if bundled is not None:
                return HeadPattern.load(bundled), f"bundled pattern {bundled.stem} (matches model {key})"
    raise PatternError(
        f"no head pattern for model {model_path}: pass --additional-config "
        "'{\"duo\": {\"pattern\": ...}}' (a JSON file, a bundled name: "
        f"{_bundled_names()}, or a reference folder)")


def _bundled_names() -> str:
    return ", ".join(bundled_patterns()) or "none installed"


def _read_json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise PatternError(f"cannot read {path}: {error.strerror or error}: check the path") from None
    except json.JSONDecodeError as error:
        raise PatternError(f"{path} is not JSON ({error}): fix or replace the file") from None
    if not isinstance(data, dict):
        raise PatternError(f"{path} holds a JSON {type(data).__name__}, not an object: fix or replace the file")
    return data


def _training_notes(training: dict, deploy_sink: int, deploy_recent: int) -> str:
    """Keeps what a reader needs from the training config.json, which the JSON pattern replaces."""
    keys = ("model_name", "sink_size", "recent_size", "context_length_min", "context_length_max", "lr",
            "reg_weight", "num_steps", "dataset_name", "dataset_format", "num_passkeys",
            "streaming_attn_implementation", "supervision", "seed")
    settings = ", ".join(f"{key}={training[key]}" for key in keys if key in training)
    return (f"training config: {settings}. Gates clipped to [0, 1] as the reference loader does. "
            f"Deploy sink/recent {deploy_sink}/{deploy_recent} (the reference uses 64/256 for LongBench and NIAH; "
            "training used sink_size/recent_size above).")


def _first_problem(error: ValidationError) -> str:
    """pydantic's first error in one line, without its multi-line report: the field, the problem, and what the field
    holds (FIELD_VALUES); the messages of our own validators say that themselves."""
    first = error.errors(include_url=False)[0]
    loc = first["loc"]
    # the keys of `masks` are sparsities, not fields: masks["0.25"][0][1] is under "masks"
    where = "".join(f"[{part}]" if isinstance(part, int) else f'["{part}"]' if loc[:index] == ("masks",)
                    else f".{part}" for index, part in enumerate(loc)).lstrip(".")
    field = "masks" if loc[:1] == ("masks",) else ".".join(part for part in loc if isinstance(part, str))
    kind = first["type"]
    value = repr(first["input"])
    value = value if len(value) <= 40 else value[:37] + "..."
    if kind == "value_error":
        return str(first["ctx"]["error"])
    if not where:
        return f"the top level ({value}) is not a JSON object: {_PATTERN_OBJECT}"
    if kind == "missing":
        return f"field `{where}` is missing: add it, {FIELD_VALUES[field]}"
    if kind == "extra_forbidden":
        section = field.rpartition(".")[0]
        known = [name.rpartition(".")[2] for name in FIELD_VALUES if name.rpartition(".")[0] == section]
        return (f"unknown field `{where}` (schema_version {SCHEMA_VERSION}): correct or remove it; the fields "
                f"{f'of `{section}` ' if section else ''}are {', '.join(known)}")
    if field == "schema_version":
        return (f"schema_version {first['input']!r} is not supported: this vllm-duo reads {SCHEMA_VERSION}; a newer "
                "file needs a newer vllm-duo")
    problem = first["msg"][0].lower() + first["msg"][1:]
    return f"`{where}` = {value}: {problem}; `{field}` must be {FIELD_VALUES[field]}"
