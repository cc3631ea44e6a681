"""What the commands of `python -m labkit` share: one-line usage errors, the bounds on their inputs, the
integer and list options, reading a model (a preset, a transformers config, a hub id or gpt:KEY=VAL,...) with
its sizes checked before anything is built, and the plain-text table."""

from __future__ import annotations

import argparse
import dataclasses
import re

UNITS_NOTE = "GiB = 2**30 bytes, MiB = 2**20, KiB = 2**10; GB = 10**9 bytes, MB = 10**6"


class UsageError(Exception):
    """Bad input from the command line: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (no usage block), exit status 2."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: error: {message}")


# ----------------------------------------------------------------------------- bounds
# Sizes are computed from shapes, never allocated, but a model is still read by building it layer by layer
# on the meta device and walking its forward once per layer (milliseconds per layer). Inputs are refused by
# rule where an answer would be meaningless or slow, never by a clock:
MAX_LAYERS = 256  # 2x the deepest published dense LLM (Llama 3.1 405B: 126 layers; PaLM 118; GPT-3 96)
MAX_SIZE = 2**24  # widths, heads, vocabulary, positions: 16,777,216, far above any published model
#                   (hidden 16,384 to 25,600, vocabularies up to 256,000, 10M positions), and small enough
#                   that every weight is a tensor PyTorch can describe (its byte count fits in int64)
MAX_WALL_LAYERS = 2 * MAX_LAYERS  # layers of all the models of one `wall` together (the default presets: 288)
INT_LIMIT = 2**63  # an integer option must fit in int64, as PyTorch's sizes do
GPU_SIZED = 2**30  # a predicted step of 1 GiB or more is a GPU's job: estimate on cpu also states cuda's peak
ADDRESS_SPACE = 2**64  # bytes a 64-bit machine can address: a larger predicted peak has no meaning
_INTEGER = re.compile(r"[+-]?[0-9]+")  # ASCII digits only: no '1_000', no other scripts' digits


def integer(text: str) -> int:
    """argparse type: a decimal integer written in ASCII digits (its range is checked by `_positive`)."""
    if not _INTEGER.fullmatch(text.strip()):
        raise ValueError(text)
    return int(text)


def _positive(parser: argparse.ArgumentParser, name: str, value) -> None:
    if value is None:
        return
    if value <= 0:
        parser.error(f"{name} must be a positive integer, got {value}")
    if value >= INT_LIMIT:
        parser.error(f"{name} must be below 2**63 (int64, as PyTorch's sizes), got {value}")


def _items(parser, name: str, text: str) -> list[str]:
    """A comma-separated option: every item present and given once. In --models a gpt: spec keeps its
    KEY=VAL items (gpt2,gpt:n_layer=2,n_embd=64 is two models)."""
    items = []
    for s in (s.strip() for s in text.split(",")):
        if name == "--models" and items and items[-1].startswith("gpt:") and "=" in s and ":" not in s:
            items[-1] += "," + s
        else:
            items.append(s)
    if not any(items):
        parser.error(f"{name} must not be empty, got {text!r}")
    if not all(items):
        parser.error(f"{name} has an empty item in {text!r}: separate items with single commas")
    dup = next((s for i, s in enumerate(items) if s in items[:i]), None)
    if dup is not None:
        parser.error(f"{name} names {dup!r} twice")
    return items


# ----------------------------------------------------------------------------- reading models
def parse_gpt_spec(text: str):
    """'gpt:n_layer=4,n_embd=256' -> GPTConfig(n_layer=4, n_embd=256); each value takes its field's type."""
    from labkit.models.gpt import GPTConfig

    fields = {f.name: f for f in dataclasses.fields(GPTConfig)}
    if text == "gpt":
        return GPTConfig()
    body = text.split(":", 1)[1]
    kwargs = {}
    for item in (s.strip() for s in body.split(",")):
        key, eq, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise ValueError(f"malformed gpt spec item {item!r} in {text!r}: write KEY=VAL items, "
                             "e.g. gpt:n_layer=4,n_embd=256 (or gpt for the defaults)")
        if key not in fields:
            raise ValueError(f"GPTConfig has no field {key!r}; fields: {', '.join(fields)}")
        if key in kwargs:
            raise ValueError(f"gpt spec gives {key} twice in {text!r}")
        kwargs[key] = _convert(key, value, type(fields[key].default))
    return GPTConfig(**kwargs)


def _convert(key: str, value: str, kind: type):
    if kind is bool:
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"gpt spec: {key} must be true or false, got {value!r}")
    if kind is int and not _INTEGER.fullmatch(value):
        raise ValueError(f"gpt spec: {key} must be int, got {value!r}")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"gpt spec: {key} must be {kind.__name__}, got {value!r}") from None


def resolve_model(text: str):
    """A preset name, config path or hub id stays a string (estimate reads it); 'gpt:...' becomes a GPTConfig."""
    if text == "gpt" or text.startswith("gpt:"):
        return parse_gpt_spec(text)
    return text


# what the estimator reads from a transformers config, by the config's own names: the layer count, sizes,
# sizes that may be None, pairs (a, b) where b must divide a, and dropout probabilities
_HF_FIELDS = {
    "gpt2": dict(layers="n_layer", sizes=("n_embd", "n_head", "vocab_size", "n_positions"), optional=("n_inner",),
                 divides=(("n_embd", "n_head"),), dropout=("resid_pdrop", "attn_pdrop", "embd_pdrop")),
    "llama": dict(layers="num_hidden_layers", sizes=("hidden_size", "num_attention_heads", "vocab_size",
                                                     "intermediate_size", "max_position_embeddings"),
                  optional=("num_key_value_heads", "head_dim"),
                  divides=(("hidden_size", "num_attention_heads"), ("num_attention_heads", "num_key_value_heads")),
                  dropout=("attention_dropout",)),
}


def _check_config(text: str, config) -> int:
    """Check a transformers config's sizes; returns its layer count (0 for an architecture not listed above)."""
    f = _HF_FIELDS.get(getattr(config, "model_type", ""))
    if f is None:  # other architectures: spec_from says which ones it knows
        return 0
    sizes = {k: getattr(config, k, None) for k in f["sizes"]}
    sizes.update({k: getattr(config, k) for k in f["optional"] if getattr(config, k, None) is not None})
    _check_sizes(text, (f["layers"], getattr(config, f["layers"], None)), sizes, f["divides"])
    if "head_dim" in sizes and sizes["num_attention_heads"] * sizes["head_dim"] > MAX_SIZE:
        raise ValueError(f"{text}: num_attention_heads x head_dim = {sizes['num_attention_heads'] * sizes['head_dim']} "
                         f"is above {MAX_SIZE:,} (2**24), far beyond any published model")
    for k in f["dropout"]:
        v = getattr(config, k, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise ValueError(f"{text}: {k} must be a dropout probability in [0, 1), got {v!r}")
    return getattr(config, f["layers"])


def _check_sizes(text: str, layers: tuple[str, object], sizes: dict[str, object], divides=()) -> None:
    """Every size a positive integer within the bounds above; pairs that must divide, divide."""
    for name, v in [layers, *sizes.items()]:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{text}: {name} must be a positive integer, got {v!r}")
    name, n = layers
    if n > MAX_LAYERS:
        raise ValueError(f"{text}: {name}={n} is more than {MAX_LAYERS} layers, twice the deepest published "
                         "dense LLM (the estimator reads a model layer by layer)")
    for name, v in sizes.items():
        if v > MAX_SIZE:
            raise ValueError(f"{text}: {name}={v} is above {MAX_SIZE:,} (2**24), far beyond any published model")
    for a, b in divides:
        if a in sizes and b in sizes and sizes[a] % sizes[b]:
            raise ValueError(f"{text}: {a} ({sizes[a]}) must be divisible by {b} ({sizes[b]})")


def _guarded(text: str, read):
    try:  # transformers validates a config, and torch a model's sizes, with errors of their own types
        return read()
    except (ValueError, TypeError, OSError):
        raise
    except Exception as err:  # one line for whatever else a library refuses in a config
        raise ValueError(f"cannot read model {text!r}: {type(err).__name__}: {err}") from err


def check_model(text: str) -> tuple[object, int]:
    """--model TEXT as estimate takes it (a GPTConfig or the name) and its layer count, its sizes checked
    against the bounds above before anything is built."""
    from labkit.models.gpt import GPTConfig

    model = resolve_model(text)
    if isinstance(model, GPTConfig):
        _check_sizes(text, ("n_layer", model.n_layer),
                     {k: getattr(model, k) for k in ("n_embd", "n_head", "vocab_size", "block_size")})
        return model, model.n_layer

    def layers():
        from labkit.models import hf

        return _check_config(text, hf.get_config(model))

    return model, _guarded(text, layers)


def read_model(model, text: str):
    """The ModelSpec of a checked model (built on the meta device, shapes only)."""
    from labkit.estimate.spec import shapes_only, spec_from

    def read():
        with shapes_only():
            return spec_from(model)

    return _guarded(text, read)


# the estimator's keyword names, as this command line spells them (messages of labkit.estimate)
_OPTION_NAMES = [(rf"(?<![\w-]){k}(?!\w)", v) for k, v in {
    "micro_batch": "--micro-batch", "optimizer_offload": "--optimizer-offload", "checkpoint": "--checkpoint",
    "step_in_backward": "--step-in-backward", "offload_activations": "--offload-activations",
    "lora_rank": "--lora-rank", "lora_targets": "--lora-targets", "lisa_layers": "--lisa-layers",
    "quant_group": "--quant-group", "selective_policy": "--selective-policy",
    "base_dtype": "--base-dtype", "loss_chunks": "--loss-chunks", "quant_set": "--quant-set",
    "paged_states": "--paged"}.items()]
_OPTION_NAMES += [(r"^(batch|seq|rank|segments) ", r"--\1 ")]


def _cli_words(message: str) -> str:
    for pattern, option in _OPTION_NAMES:
        message = re.sub(pattern, option, message)
    return message


def _error_words(err: Exception) -> str:
    """An error in the command line's words; an estimator's refusal says first whether the techniques are
    incompatible or labkit does not estimate them yet (labkit.estimate.refusal)."""
    from labkit.estimate.refusal import Refused

    kind = f"{err.kind.value}: " if isinstance(err, Refused) else ""
    return kind + _cli_words(str(err))


def _check_peak(peak: int, what: str) -> None:
    if peak > ADDRESS_SPACE:
        raise ValueError(f"{what}: the predicted peak, {peak:.3g} bytes, is beyond 2**64 bytes, all a 64-bit "
                         "machine can address; lower --batch or --seq or the model's size")


# ----------------------------------------------------------------------------- output
def _table(rows: list[list[str]], right: set[int] = frozenset()) -> str:
    """rows[0] is the header; within 120 columns, a long cell wrapping at its words in its own column."""
    from labkit.memory.table import Table

    return Table(rows[0], rows[1:], set(right), rule=False).text()


# ----------------------------------------------------------------------------- sizes and verdicts
def size_option(parser, name: str, text: str) -> int:
    """A memory size option's bytes: its unit required (labkit.memory.units.parse_size_option), from one byte
    to 2**64 bytes; one line naming the option otherwise."""
    from labkit.memory.units import parse_size_option

    try:
        b = parse_size_option(text)
    except ValueError as err:
        parser.error(f"{name}: {err}")
    if not 1 <= b <= ADDRESS_SPACE:
        parser.error(f"{name} must be from 1 byte to 2**64 bytes, got {text!r}")
    return b


def headroom_fraction(parser, percent: float) -> float:
    import math

    if not (math.isfinite(percent) and 0 <= percent < 100):
        parser.error(f"--headroom is a percentage of the budget from 0 to below 100, got {percent:g}")
    return percent / 100


def verdict_line(peak: int, budget: int, headroom: float) -> str:
    """plan's rule in words: 'fits', 'tight' or 'does not fit', with the bytes left or missing."""
    from labkit.memory.units import DOES_NOT_FIT, TIGHT, fit_verdict, fmt_bytes

    v = fit_verdict(peak, budget, headroom)
    if v == DOES_NOT_FIT:
        return f"does not fit: {fmt_bytes(peak)} > {fmt_bytes(budget)} ({fmt_bytes(peak - budget)} over)"
    left = f"{fmt_bytes(budget - peak)} left of {fmt_bytes(budget)}"
    if v == TIGHT:
        return (f"tight: fits with {left}, within {headroom:.0%} of the budget (the allocator's cache and the "
                "CUDA context are not in the predicted bytes): verify it on the device")
    return f"fits: {left}"
