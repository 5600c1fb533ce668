"""Model configuration, parsed once from a checkpoint's ``config.json``.

One frozen dataclass covers the three hybrid families:

* ``qwen3_next``                      (Qwen3-Next: grouped ``in_proj_qkvz`` / ``in_proj_ba``)
* ``qwen3_5`` / ``qwen3_5_text``      (Qwen3.5 dense: separate ``in_proj_qkv/z/b/a``)
* ``qwen3_5_moe`` / ``qwen3_5_moe_text`` (Qwen3.5-MoE)

Multimodal wrappers (``qwen3_5``, ``qwen3_5_moe``) nest the language model's fields under
``text_config``; we read those and ignore the vision side.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

# model_type -> (family, is_moe_family)
_ARCHS = {
    "qwen3_next": ("qwen3_next", True),
    "qwen3_5": ("qwen3_5", False),
    "qwen3_5_text": ("qwen3_5", False),
    "qwen3_5_moe": ("qwen3_5", True),
    "qwen3_5_moe_text": ("qwen3_5", True),
}
SUPPORTED_MODEL_TYPES = tuple(_ARCHS)
# transformers' class-name prefixes (config.json "architectures") -> model_type without "_text"
_ARCH_CLASSES = {"Qwen3NextFor": "qwen3_next", "Qwen3_5MoeFor": "qwen3_5_moe", "Qwen3_5For": "qwen3_5"}

LINEAR = "linear_attention"
FULL = "full_attention"


# Parameters a checkpoint keeps in fp32 whatever the model's dtype (the DeltaNet decay terms);
# hyspec.loading.cast_params applies it, everything that sizes or builds a model follows it.
FP32_PARAMS = ("A_log", "dt_bias")

# The model dtypes one can ask for by name (--dtype, Engine.load); hyspec.loading.DTYPES maps them.
DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")


def keeps_fp32(name: str) -> bool:
    """Whether parameter `name` stays fp32 in a non-fp64 model (see FP32_PARAMS)."""
    return name.endswith(FP32_PARAMS)


# The one wording of "this model cannot draft": every path that refuses speculation (engine,
# scheduler, server, fast path, replay) builds its error from these, adding its own tail.
NO_MTP_HEAD = "this checkpoint has no MTP head (no mtp.* weights)"
NO_MTP_SPEC_TAIL = ", so it cannot speculate; use --draft 0 for plain decoding"


def no_mtp_error(tail: str = NO_MTP_SPEC_TAIL) -> ValueError:
    """The ValueError raised when speculation (or drafting) is asked of a model without MTP weights."""
    return ValueError(NO_MTP_HEAD + tail)


def input_file(path, what: str) -> Path:
    """`path` (a user's ~ expanded) when it is a file to read; else ValueError naming `what`
    (the flag or argument): "WHAT: 'p' is a directory, not a file" or "WHAT: no such file 'p'"."""
    if str(path) == "":  # (Path('') is the current directory: "'' is a directory" misled)
        raise ValueError(f"{what}: the file name is empty")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"{what}: {str(path)!r} is a directory, not a file" if p.is_dir() else
                         f"{what}: no such file {str(path)!r}")
    return p


def read_text_file(path, what: str) -> str:
    """The UTF-8 text of the file `path` (:func:`input_file`'s checks; line ends read as
    ``open``'s text mode reads them: \\r\\n and \\r as \\n); ValueError naming `what` and the
    file where it is not UTF-8."""
    p = input_file(path, what)
    try:
        return p.read_bytes().decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what}: {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start + 1})") from None


class ConfigError(ValueError):
    """config.json is missing, malformed, or describes a model we cannot run."""


def finite_number(v) -> bool:
    """A number that is a finite float (Infinity / NaN literals and 10**400 are not)."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def finite_json(x):
    """x with every non-finite float as None, through dicts, lists and tuples: strict JSON
    has no NaN or Infinity (a diverged run's losses, a perplexity past a float's range)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x


SAMPLING_DEFAULT_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def checkpoint_sampling_defaults(path: str | Path) -> dict:
    """The sampling settings a checkpoint recommends, from its generation_config.json (the
    fields transformers' generate and vLLM's server take from it): with "do_sample": true its
    temperature, top_k, top_p, min_p and repetition_penalty, with do_sample false or absent
    (transformers then decodes greedily) its repetition_penalty alone; {} without the file
    or any of them. A value our sampler refuses (a negative top_p, a string) is a
    ConfigError naming the file and the field."""
    from hyspec.sampling import SamplingParams

    gen = Path(path) / "generation_config.json"
    if not gen.is_file():
        return {}
    g = read_json(gen)
    if not isinstance(g, dict):
        raise ConfigError(f"{gen}: top level must be a JSON object")
    sample = g.get("do_sample", False)
    if not isinstance(sample, bool):
        raise ConfigError(f"{gen}: do_sample must be true or false, got {sample!r}")
    names = SAMPLING_DEFAULT_FIELDS if sample else ("repetition_penalty",)
    out = {}
    for name in names:
        v = g.get(name)
        if v is None:
            continue
        want = int if name == "top_k" else float
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (want is int and not isinstance(v, int)):
            raise ConfigError(f"{gen}: {name} must be a{'n integer' if want is int else ' number'}, got {v!r}")
        out[name] = want(v)
    if out.get("top_k", 0) < 0:  # (transformers' "off" is 0 too; -1 is vLLM's)
        out["top_k"] = 0
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ConfigError(f"{gen}: {e}") from None
    return out


def read_json(p: Path) -> Any:
    """A checkpoint's JSON file; ConfigError naming the file when it is not UTF-8 JSON."""
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start + 1})") from None


# storage dtypes of the Gated DeltaNet state (the `mamba_ssm_dtype` field, the `ssm_dtype` option)
SSM_DTYPES = ("float32", "bfloat16", "float16")
_SSM_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
SSM_CHOICES = SSM_DTYPES + tuple(_SSM_ALIASES) + ("auto",)  # what --ssm-dtype takes


def _ssm_dtype_field(v):
    """A state dtype name with its alias resolved; None / "auto" (the default) -> None.
    Unknown values pass through (ModelConfig / with_ssm_dtype reject them)."""
    if v is None or v == "auto":
        return None
    return _SSM_ALIASES.get(v, v) if isinstance(v, str) else v


def with_ssm_dtype(cfg: "ModelConfig", ssm_dtype: str | None) -> "ModelConfig":
    """cfg with the Gated DeltaNet state stored in `ssm_dtype` (None: cfg unchanged;
    "auto": the checkpoint's choice; else one of SSM_DTYPES or fp32/bf16/fp16)."""
    name = _ssm_dtype_field(ssm_dtype)
    if name is None:
        return cfg
    if name not in SSM_DTYPES:
        raise ValueError(f"ssm_dtype must be one of {', '.join(SSM_DTYPES)} (or auto), got {ssm_dtype!r}")
    return replace(cfg, mamba_ssm_dtype=name)


def dict_with_ssm_dtype(d: dict, ssm_dtype: str | None) -> dict:
    """A config dict (the bench's models, the presets) with `mamba_ssm_dtype` set as
    with_ssm_dtype would set it (None / "auto": d unchanged)."""
    name = _ssm_dtype_field(ssm_dtype)
    return d if name is None else {**d, "mamba_ssm_dtype": name}


ROPE_TYPES = ("default", "linear", "yarn")
DEFAULT_MAX_POSITIONS = 32768  # max_position_embeddings when config.json leaves it out
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
              "mscale_all_dim", "truncate")


def _rope_scaling(rope: dict, d: dict, max_positions: int) -> tuple[str, tuple]:
    """(rope_type, its parameters as sorted pairs) from the merged rope dict; ConfigError for
    a type the model code does not implement (it must not run as plain RoPE silently).
    max_positions: the config's max_position_embeddings as ModelConfig reads it (YaRN's
    factor defaults to it over the original length)."""
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise ConfigError(f"config.json: rope_parameters.rope_type {kind!r} is not supported (supported: "
                          f"{', '.join(ROPE_TYPES)}); remove the rope scaling from config.json to run with "
                          "plain RoPE")
    if kind == "default":
        return kind, ()

    def num(key: str, default=None, *, positive: bool = True):
        v = rope.get(key, default)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not finite_number(v) or (positive and not v > 0):
            raise ConfigError(f"config.json: rope_parameters.{key} must be a {'positive' if positive else 'finite'} "
                              f"number for rope_type "
                              f"{kind!r}, got {v!r}")
        return float(v)

    factor = num("factor")
    if kind == "linear":
        if factor is None:
            raise ConfigError("config.json: rope_parameters.factor is required for rope_type 'linear'")
        return kind, (("factor", factor),)
    top = d.get("original_max_position_embeddings")
    if top is not None:
        # a top-level value wins over the rope dict's, as in transformers' standardize_rope_params
        # (Phi3-style configs keep the pretraining length there)
        if isinstance(top, bool) or not isinstance(top, (int, float)) or not finite_number(top) or not top > 0:
            raise ConfigError(f"config.json: original_max_position_embeddings must be a positive number, got {top!r}")
        rope = {**rope, "original_max_position_embeddings": top}
    orig = num("original_max_position_embeddings", d.get("max_position_embeddings"))
    if orig is None:
        raise ConfigError("config.json: rope_parameters.original_max_position_embeddings is required for "
                          "rope_type 'yarn'")
    if factor is None:  # (the length ModelConfig reads, its default included: an absent one made NaN frequencies)
        factor = float(max_positions) / orig
    truncate = rope.get("truncate", True)
    truncate = False if truncate is None else truncate  # (null: read as false, as transformers' `if truncate`)
    if not isinstance(truncate, bool):  # (bool("false") is True)
        raise ConfigError(f"config.json: rope_parameters.truncate must be true or false, got {truncate!r}")
    vals = {"factor": factor, "original_max_position_embeddings": orig, "beta_fast": num("beta_fast") or 32.0,
            "beta_slow": num("beta_slow") or 1.0, "attention_factor": num("attention_factor"),
            "mscale": num("mscale", positive=False), "mscale_all_dim": num("mscale_all_dim", positive=False),
            "truncate": truncate}
    return kind, tuple(sorted((k, v) for k, v in vals.items() if v is not None))


DEFAULT_HEAD_DIM = 256  # transformers' Qwen3NextConfig / Qwen3_5TextConfig / Qwen3_5MoeTextConfig default


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # FFN (dense and/or MoE)
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # misc
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    mtp_num_hidden_layers: int = 0
    eos_token_ids: tuple[int, ...] = ()
    # the Gated DeltaNet state's storage dtype ("float32", "bfloat16", "float16"); None: the
    # accumulation dtype (fp32; fp64 for fp64 models).  From config.json's `mamba_ssm_dtype`
    # (Qwen3.5 ships "float32") or the user's `ssm_dtype` option; computed in fp32 either way.
    mamba_ssm_dtype: str | None = None
    # RoPE scaling (config.json's rope_parameters / rope_scaling): "default", "linear" or
    # "yarn", and that type's parameters as sorted (name, value) pairs (hyspec.model.ops.rope_frequencies)
    rope_type: str = "default"
    rope_scaling: tuple = ()
    # raw dict kept for round-tripping (not compared)
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------
    @property
    def family(self) -> str:
        return _ARCHS[self.model_type][0]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:  # nk * dk
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:  # nv * dv
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:  # channels convolved: q | k | v
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_moe_layer(self, i: int) -> bool:
        """MoE on layer i iff experts exist, i is not dense-only, and (i+1) % step == 0.

        The MTP block uses index ``num_hidden_layers`` (it follows the last target layer)."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def has_moe(self) -> bool:
        return self.num_experts > 0

    def __post_init__(self) -> None:
        def bad(field_name: str, why: str) -> ConfigError:
            return ConfigError(f"config.json: field '{field_name}' {why}")

        if self.model_type not in _ARCHS:
            raise bad("model_type", f"is {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
                     "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(name, f"must be a positive integer, got {v!r}")
        bad_eos = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad_eos:
            raise bad("eos_token_id", f"has id(s) {bad_eos[:5]} outside the vocabulary of {self.vocab_size}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad("layer_types", f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        for t in self.layer_types:
            if t not in (LINEAR, FULL):
                raise bad("layer_types", f"has unknown layer type {t!r} (expected {LINEAR!r} or {FULL!r})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", f"({self.num_key_value_heads}) must divide num_attention_heads "
                      f"({self.num_attention_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise bad("linear_num_value_heads", f"({self.linear_num_value_heads}) must be a multiple of "
                      f"linear_num_key_heads ({self.linear_num_key_heads})")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise bad("partial_rotary_factor", f"={self.partial_rotary_factor} gives an odd or empty rotary "
                      f"dim {self.rotary_dim} for head_dim {self.head_dim}")
        if self.num_experts > 0:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise bad("num_experts_per_tok", f"={self.num_experts_per_tok} must be in 1..{self.num_experts}")
            if self.moe_intermediate_size <= 0:
                raise bad("moe_intermediate_size", "must be positive for a MoE model")
            if self.decoder_sparse_step <= 0:
                raise bad("decoder_sparse_step", "must be positive")
        if self.mamba_ssm_dtype is not None and self.mamba_ssm_dtype not in SSM_DTYPES:
            raise bad("mamba_ssm_dtype", f"is {self.mamba_ssm_dtype!r}; supported: {', '.join(SSM_DTYPES)} "
                      "(or leave it out: float32)")
        if any(self.is_moe_layer(i) is False for i in range(self.num_hidden_layers)) and self.intermediate_size <= 0:
            raise bad("intermediate_size", "must be positive when some layers are dense")

    # ---- parsing -------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError("config.json: top level must be a JSON object")
        outer = d
        mt = d.get("model_type")
        if mt is None:
            raise ConfigError("config.json: field 'model_type' is missing")
        if not isinstance(mt, str):
            raise ConfigError(f"config.json: field 'model_type' must be a string, got {type(mt).__name__}")
        if mt not in _ARCHS:
            raise ConfigError(f"config.json: field 'model_type' is {mt!r}; supported: "
                              f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        archs = d.get("architectures")
        if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            raise ConfigError(f"config.json: field 'architectures' must be a list of class names, got {archs!r}")
        named = {_ARCH_CLASSES[p] for a in archs or () for p in _ARCH_CLASSES if a.startswith(p)}
        if named and mt.removesuffix("_text") not in named:  # (it listed the other family's missing tensors)
            raise ConfigError(f"config.json: architectures {archs} are the {' / '.join(sorted(named))} family but "
                              f"model_type is {mt!r}: the two disagree (the weights follow the architecture)")
        if d.get("text_config") is not None and not isinstance(d["text_config"], dict):
            raise ConfigError(f"config.json: field 'text_config' must be an object, got "
                              f"{type(d['text_config']).__name__}")
        if isinstance(d.get("text_config"), dict):
            d = {**d["text_config"]}
            d.setdefault("model_type", mt + "_text")
            if not isinstance(d["model_type"], str) or d["model_type"] not in _ARCHS:
                d["model_type"] = mt + "_text"
            # a few fields may live on the wrapper only
            for k in ("tie_word_embeddings", "eos_token_id"):
                if k not in d and k in outer:
                    d[k] = outer[k]
            if "tie_word_embeddings" in outer:  # transformers ties a *ForConditionalGeneration head by the
                d["tie_word_embeddings"] = outer["tie_word_embeddings"]  # wrapper's value, whatever text_config says

        def need(k: str) -> Any:
            if k not in d:
                raise ConfigError(f"config.json: required field '{k}' is missing (model_type {d['model_type']!r})")
            return d[k]

        def bad(k: str, what: str, v) -> ConfigError:
            return ConfigError(f"config.json: field '{k}' must be {what}, got {v!r}")

        def integer(k: str, default: int, minimum: int = 0) -> int:  # null / absent: the default
            v = d.get(k)
            if v is None:
                return default
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise bad(k, f"an integer >= {minimum}", v)
            return v

        def number(k: str, default: float, value=None) -> float:  # a positive number
            v = d.get(k) if value is None else value
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
                raise bad(k, "a positive number", v)
            return float(v)

        def flag(k: str, default: bool, src: dict | None = None) -> bool:
            v = (d if src is None else src).get(k)
            if v is None:
                return default
            if not isinstance(v, bool):
                raise bad(k, "true or false", v)
            return v

        def token_ids(k: str, v, where: str = "config.json") -> tuple[int, ...]:
            ids = tuple(v) if isinstance(v, (list, tuple)) else (v,)
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ConfigError(f"{where}: field '{k}' must be a token id or a list of token ids, got {v!r}")
            return ids

        n_layers = need("num_hidden_layers")
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers <= 0:
            raise bad("num_hidden_layers", "a positive integer", n_layers)
        layer_types = d.get("layer_types")
        if layer_types is not None and not isinstance(layer_types, (list, tuple)):
            raise bad("layer_types", "a list of layer types", layer_types)
        if layer_types is None:
            interval = d.get("full_attention_interval", 4)
            if not isinstance(interval, int) or isinstance(interval, bool) or interval <= 0:  # (true was 1)
                raise ConfigError(f"config.json: field 'full_attention_interval' must be a positive int, got {interval!r}")
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]

        # transformers 5 writes rope_parameters; older configs (and the model cards' long-context
        # recipe) rope_scaling, which transformers lets win over rope_parameters
        for k in ("rope_scaling", "rope_parameters"):
            if d.get(k) is not None and not isinstance(d[k], dict):
                raise bad(k, "an object", d[k])
        for k in ("rope_scaling", "rope_parameters"):  # transformers' per-layer-type form: {layer type: {...}}
            nested = sorted(t for t, v in (d.get(k) or {}).items()
                            if isinstance(v, dict) and (t in layer_types or str(t).endswith("_attention")))
            if nested:
                raise ConfigError(f"config.json: {k} nested by layer type ({', '.join(nested)}) is not supported "
                                  "for these families (transformers does not load it either); give one object "
                                  "of RoPE parameters")
        scaling = dict(d.get("rope_scaling") or {})
        if "type" in scaling:  # the older spelling of rope_type
            scaling.setdefault("rope_type", scaling.pop("type"))
        rope = {**(d.get("rope_parameters") or {}), **scaling}
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        prf = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
        max_positions = integer("max_position_embeddings", DEFAULT_MAX_POSITIONS, 1)
        rope_type, rope_scaling = _rope_scaling(rope, d, max_positions)
        if flag("attention_bias", False):
            raise ConfigError("config.json: attention_bias true is not supported (the gated attention of these "
                              "families has no projection biases)")
        if flag("use_sliding_window", False):  # (was ignored: full attention computed in its place)
            raise ConfigError("config.json: use_sliding_window true is not supported (these families' attention "
                              "layers attend to the whole context)")
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ConfigError(f"config.json: hidden_act {act!r} is not supported (these families use 'silu')")
        n_heads = need("num_attention_heads")
        # absent: 256, these families' default in transformers (its configs read so; hidden_size /
        # heads was taken, which refused a checkpoint transformers loads); null or 0: hidden_size / heads
        head_dim = d.get("head_dim", DEFAULT_HEAD_DIM)
        if not head_dim:  # hidden_size / heads, which must then divide
            hidden = need("hidden_size")
            if isinstance(hidden, int) and isinstance(n_heads, int) and n_heads > 0 and hidden % n_heads:
                raise ConfigError(f"config.json: field 'num_attention_heads' ({n_heads}) must divide hidden_size "
                                  f"({hidden}) when head_dim is not given")
            head_dim = hidden // n_heads if isinstance(hidden, int) and isinstance(n_heads, int) and n_heads else 0

        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else token_ids("eos_token_id", eos)
        is_moe = _ARCHS[d["model_type"]][1]
        n_experts = integer("num_experts", 0) if is_moe else 0
        if n_experts and d.get("num_experts_per_tok") is None:  # (it read as 0: "=0 must be in 1..N")
            need("num_experts_per_tok")  # absent: named missing
            raise bad("num_experts_per_tok", f"an integer in 1..{n_experts}", None)
        mlp_only = d.get("mlp_only_layers") or ()
        if not isinstance(mlp_only, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
            raise bad("mlp_only_layers", "a list of layer indices", mlp_only)
        mtp_key = "mtp_num_hidden_layers" if "mtp_num_hidden_layers" in d else "num_nextn_predict_layers"
        # Qwen3.5-MoE (transformers' model): every layer is MoE and the top-k weights are always
        # renormalised; norm_topk_prob / decoder_sparse_step / mlp_only_layers are Qwen3-Next's
        # fields, which its config may carry but its model never reads (a dense layer was
        # refused, "false" changed the routing)
        qwen3_next_moe_fields = d["model_type"].removesuffix("_text") != "qwen3_5_moe"
        return cls(
            model_type=d["model_type"],
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=n_heads,
            num_key_value_heads=need("num_key_value_heads"),
            head_dim=head_dim,
            rope_theta=number("rope_theta", 10000.0, rope_theta),
            partial_rotary_factor=number("partial_rotary_factor", 0.25, prf),
            linear_num_key_heads=need("linear_num_key_heads"),
            linear_num_value_heads=need("linear_num_value_heads"),
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4),
            intermediate_size=integer("intermediate_size", 0),
            num_experts=n_experts,
            num_experts_per_tok=integer("num_experts_per_tok", 0) if n_experts else 0,
            moe_intermediate_size=integer("moe_intermediate_size", 0),
            shared_expert_intermediate_size=integer("shared_expert_intermediate_size", 0),
            norm_topk_prob=flag("norm_topk_prob", True) if qwen3_next_moe_fields else True,
            decoder_sparse_step=integer("decoder_sparse_step", 1, 1) if qwen3_next_moe_fields else 1,
            mlp_only_layers=tuple(mlp_only) if qwen3_next_moe_fields else (),
            rms_norm_eps=number("rms_norm_eps", 1e-6),
            tie_word_embeddings=flag("tie_word_embeddings", False),
            attention_bias=False,  # (true refused above)
            max_position_embeddings=max_positions,
            mtp_num_hidden_layers=integer(mtp_key, 0),
            eos_token_ids=eos_ids,
            mamba_ssm_dtype=_ssm_dtype_field(d.get("mamba_ssm_dtype", outer.get("mamba_ssm_dtype"))),
            rope_type=rope_type,
            rope_scaling=rope_scaling,
            raw=outer,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path) / "config.json"
        if not p.is_file():
            raise ConfigError(f"no config.json in {path}")
        d = read_json(p)
        cfg = cls.from_dict(d)
        gen = Path(path) / "generation_config.json"
        if gen.is_file():
            g = read_json(gen)
            if not isinstance(g, dict):
                raise ConfigError(f"{gen}: top level must be a JSON object")
            eos = g.get("eos_token_id")
            if eos is not None:
                ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
                if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < cfg.vocab_size for t in ids):
                    raise ConfigError(f"{gen}: eos_token_id must be token ids below the vocabulary size "
                                      f"{cfg.vocab_size}, got {eos!r}")
                merged = tuple(dict.fromkeys(ids + cfg.eos_token_ids))
                cfg = cls(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "eos_token_ids": merged})
        return cfg

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "raw"}
        d["layer_types"] = list(self.layer_types)
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        return d
