"""Load a checkpoint directory (config.json + one or many safetensors files) into HybridLM.

Accepted layouts: a single ``model.safetensors``, shards listed in
``model.safetensors.index.json``, or any ``*.safetensors`` files in the directory; keys
with the multimodal prefix ``model.language_model.``; tied or untied LM head; routed
experts stored per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``) or stacked
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]); FP8
block-quantized checkpoints (``quantization_config`` with ``quant_method: fp8``, see
hyspec/quant.py), dequantized at load or (``fp8="keep"``, the default on CUDA) kept in
float8 with their block scales.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import torch

from hyspec.config import DTYPE_NAMES, ConfigError, ModelConfig, keeps_fp32, read_json, with_ssm_dtype
from hyspec.model.hybrid import HybridLM

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


class CheckpointError(ValueError):
    """A checkpoint's files or tensors are missing, corrupt or of the wrong shape."""


def parse_dtype(name: str | torch.dtype, device="cpu") -> torch.dtype:
    """A dtype name -> torch.dtype; "auto" is bfloat16 on CUDA (the GPU kernels' tuned dtype,
    and the published checkpoints' own) and float32 elsewhere (exact on the CPU)."""
    if isinstance(name, torch.dtype):
        if name not in DTYPES.values():
            raise ValueError(f"dtype {name} is not a model dtype; choose one of auto, {', '.join(DTYPES)}")
        return name
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


_IGNORED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.")


def _normalize(key: str) -> str | None:
    """Map a checkpoint key onto our parameter names (None: not part of the language model)."""
    if key.startswith(_IGNORED_PREFIXES):
        return None
    for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                     ("language_model.lm_head.", "lm_head."), ("model.mtp.", "mtp.")):
        if key.startswith(old):
            return new + key[len(old):]
    return key


def _shard_files(path: Path) -> tuple[list[Path], dict | None]:
    """(the weights files to read, the index's {tensor name: shard file} or None without one)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:  # (not JSON, not UTF-8, no weight_map)
            raise CheckpointError(f"{index}: malformed shard index ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names")
        for f in set(weight_map.values()):
            if Path(f).name != f or f in (".", ".."):
                raise CheckpointError(f"{index} names shard {f!r}: shards must be files in the checkpoint folder")
        if not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' names no shard")
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index} lists shard {f.name}, which does not exist")
        # the index must name every shard of a series it uses (PREFIX-0000i-of-0000N): one it
        # leaves out is a damaged index (its tensors were reported missing, or config.json blamed)
        listed = {f.name for f in files}
        for f in files:
            m = re.fullmatch(r"(.*)-(\d+)-of-(\d+)\.safetensors", f.name)
            if m:
                of = m.group(3)
                left = [f"{m.group(1)}-{i:0{len(of)}d}-of-{of}.safetensors" for i in range(1, int(of) + 1)]
                left = [n for n in left if n not in listed and (path / n).is_file()]
                if left:
                    raise CheckpointError(f"{index} leaves out shard {left[0]} of the series {f.name} belongs to "
                                          f"(its 'weight_map' names {len(listed)} file(s)): a damaged index?")
        return files, weight_map
    files = sorted(path.glob("*.safetensors"))
    if not files and not os.access(path, os.R_OK):  # (glob finds nothing in a folder it cannot list)
        raise CheckpointError(f"{path}: permission denied (the folder's files cannot be listed)")
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    # without an index, shards named like transformers' (PREFIX-00003-of-00029) must all be there:
    # an interrupted download would otherwise load with tensors missing or silently short
    series: dict[tuple[str, str], set[int]] = {}
    for f in files:
        m = re.fullmatch(r"(.*)-(\d+)-of-(\d+)\.safetensors", f.name)
        if m:
            series.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(2)))
    for (prefix, of), have in series.items():
        total = int(of)
        missing = sorted(set(range(1, total + 1)) - have)
        if missing:
            names = ", ".join(f"{prefix}-{i:0{len(of)}d}-of-{of}.safetensors" for i in missing[:3])
            raise CheckpointError(f"{path}: {len(missing)} of {total} shard(s) missing ({names}"
                                  f"{', ...' if len(missing) > 3 else ''}): an incomplete download?")
    return files, None


def _quant_config(path: Path):
    from hyspec.quant import parse_quantization_config

    p = path / "config.json"
    if not p.is_file():
        return None
    raw = read_json(p)
    return parse_quantization_config(raw) if isinstance(raw, dict) else None


def read_tensors(path: str | Path, *, dequantize: bool = True, dtype: torch.dtype = torch.float32,
                 keep=None) -> dict[str, torch.Tensor]:
    """All language-model tensors of a checkpoint directory, keys normalised (on CPU).

    FP8 block-quantized checkpoints (hyspec/quant.py): with ``dequantize`` (the default)
    every float8 weight comes back in `dtype` (computed in fp32, one tensor at a time), its
    ``*_scale_inv`` consumed, and per-expert
    keys are stacked as usual. ``dequantize=False`` is the hook for a GPU FP8 path: the
    float8 weights and their scales come back as stored (keys normalised, per-expert
    keys NOT stacked), after the same validation of the quantization config
    (``hyspec.quant.prepare_fp8`` then stacks them for load_model(fp8="keep")).
    keep: optional predicate on the normalised key; other tensors are never read (a
    pipeline stage reads only its own layers)."""
    from safetensors import safe_open

    from hyspec.quant import dequantize_tensors

    qcfg = _quant_config(Path(path))
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, tuple[str, str]] = {}  # normalised key -> (its key in the file, the file)
    files, weight_map = _shard_files(Path(path))
    for f in files:
        size = f.stat().st_size
        if not os.access(f, os.R_OK):
            raise CheckpointError(f"{f}: permission denied (the weights file is not readable)")
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                if weight_map is not None:  # every tensor the index places in this shard is in it (as
                    # transformers, which reads tensors by the index, needs): another checkpoint's index passed
                    held = set(sf.keys())
                    absent = [k for k, shard in weight_map.items() if shard == f.name and k not in held]
                    if absent:
                        raise CheckpointError(f"model.safetensors.index.json places {len(absent)} tensor(s) in "
                                              f"{f.name} that it does not hold, e.g. {absent[0]!r}: the index is "
                                              f"another checkpoint's, or damaged")
                for key in sf.keys():
                    k = _normalize(key)
                    if k is not None and (keep is None or keep(k)):
                        if k in origin:  # (one file may hold a key twice over: model.X and model.language_model.X)
                            okey, ofile = origin[k]
                            what = (f"tensor {key!r} is in both {ofile} and {f.name}" if okey == key else
                                    f"tensor {k!r} is stored twice, as {okey!r} ({ofile}) and {key!r} ({f.name})")
                            raise CheckpointError(f"{what}: which one to load is ambiguous")
                        out[k], origin[k] = sf.get_tensor(key), (key, f.name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for bad files
            raise CheckpointError(f"{f.name}: cannot read safetensors file ({size} bytes): {e}") from None
    if not dequantize:
        return out
    return _stack_experts(dequantize_tensors(out, qcfg, dtype))


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def check_experts(prefix: str, experts: dict[int, dict[str, torch.Tensor]]) -> int:
    """Check one layer's per-expert tensors ({expert id: {"gate_proj": w, ...}}) before they
    are stacked: ids 0..n-1 with all three parts each, matrices of a floating-point dtype (a
    copy into the stack would turn integers into other numbers silently), each part of one
    shape across the experts. Returns n."""
    n = max(experts) + 1
    if len(experts) != n:
        gap = min(e for e in range(n) if e not in experts)
        raise CheckpointError(f"'{prefix}' has tensors of {len(experts)} experts with ids up to {n - 1}: expert "
                              f"{gap} is missing (missing tensor '{prefix}.{gap}.gate_proj.weight')")
    for e in range(n):
        for part in ("gate_proj", "up_proj", "down_proj"):
            if part not in experts[e]:
                raise CheckpointError(f"missing tensor '{prefix}.{e}.{part}.weight'")
            w, first = experts[e][part], experts[0][part]
            name = f"{prefix}.{e}.{part}.weight"
            if not w.is_floating_point():
                raise CheckpointError(f"tensor '{name}' is stored as {w.dtype}; a weight must be a floating-point "
                                      f"tensor")
            if w.dim() != 2:
                raise CheckpointError(f"tensor '{name}' has shape {list(w.shape)}; an expert's weight is a matrix")
            if tuple(w.shape) != tuple(first.shape):
                raise CheckpointError(f"tensor '{name}' has shape {list(w.shape)}, expert 0's is "
                                      f"{list(first.shape)}")
    if experts[0]["gate_proj"].shape[1] != experts[0]["up_proj"].shape[1]:
        raise CheckpointError(f"'{prefix}.0.gate_proj.weight' and '{prefix}.0.up_proj.weight' have shapes "
                              f"{list(experts[0]['gate_proj'].shape)} and {list(experts[0]['up_proj'].shape)}: "
                              "their columns (the hidden size) differ")
    return n


def _stack_experts(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert keys -> stacked gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k in list(t):
        m = _EXPERT.match(k)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t.pop(k)
    for prefix in list(groups):
        experts = groups.pop(prefix)  # one layer's per-expert tensors are let go once stacked: the host
        n = check_experts(prefix, experts)  # holds the checkpoint once, plus one layer's experts, not twice
        gate, up = experts[0]["gate_proj"], experts[0]["up_proj"]
        gate_up = torch.empty((n, gate.shape[0] + up.shape[0], *gate.shape[1:]), dtype=gate.dtype)
        down = torch.empty((n, *experts[0]["down_proj"].shape), dtype=experts[0]["down_proj"].dtype)
        for e in range(n):
            w = experts.pop(e)
            gate_up[e, : w["gate_proj"].shape[0]] = w["gate_proj"]
            gate_up[e, w["gate_proj"].shape[0]:] = w["up_proj"]
            down[e] = w["down_proj"]
        t[f"{prefix}.gate_up_proj"], t[f"{prefix}.down_proj"] = gate_up, down
    return t


def cast_params(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """model.to(dtype), except the parameters a checkpoint keeps in fp32 (config.keeps_fp32),
    which a non-fp64 model holds in fp32. Every builder of a model (loader, presets, bench) uses it."""
    model = model.to(dtype)
    if dtype != torch.float64:
        for name, p in model.named_parameters():
            if keeps_fp32(name):
                p.data = p.data.float()
    return model


def _keep_fp8(model: torch.nn.Module, tensors: dict[str, torch.Tensor], qcfg) -> list[str]:
    """Make the (meta) model keep the checkpoint's fp8 weights: every float8 tensor that is a
    parameter of the model (in its shape) becomes a float8 parameter with its scale buffers.
    Stacked experts stored transposed are dequantized here instead (their block would be
    transposed too), and so is a quantized weight whose module reads it as a plain tensor
    (router, embedding, LM head: Qwen leaves them bf16, a checkpoint that quantizes them
    loads as with fp8="dequantize"). Returns the parameter names kept in fp8."""
    from hyspec.model.ffn import Experts
    from hyspec.model.ops import Linear
    from hyspec.quant import SCALE_SUFFIX, dequantize, is_fp8, keep_fp8_params

    params = dict(model.named_parameters())
    specs = {}

    def computes_in_fp8(k: str) -> bool:  # (the modules whose forward dequantizes on the fly: module_weight)
        mod_name, _, attr = k.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        return ((isinstance(mod, Linear) and attr == "weight" and k != "lm_head.weight")
                or (isinstance(mod, Experts) and attr in ("gate_up_proj", "down_proj")))

    for k in [k for k, v in tensors.items() if is_fp8(v)]:
        p = params.get(k)
        scale = tensors[k + SCALE_SUFFIX]
        if p is not None and tuple(p.shape) == tuple(tensors[k].shape) and computes_in_fp8(k):
            rows = tensors.get(k + "_scale_rows")
            specs[k] = (tuple(scale.shape), None if rows is None else rows.shape[0])
        else:  # not a parameter here (the loader reports it), stored transposed, or read unquantized
            tensors[k] = dequantize(tensors[k], tensors.pop(k + SCALE_SUFFIX), qcfg.block, name=k,
                                    rows=tensors.pop(k + "_scale_rows", None))
    keep_fp8_params(model, specs, qcfg.block)
    return list(specs)


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")
# MTP layers past the first (mtp_num_hidden_layers > 1): hyspec drafts with mtp.layers.0 only (warned once)
_LATER_MTP_LAYER = re.compile(r"^mtp\.layers\.0*[1-9]\d*\.")


def stage_keeps(key: str, layers: range, last: bool) -> bool:
    """Whether a pipeline stage holding decoder `layers` (and, on the last stage, the final
    norm, LM head and MTP head) reads checkpoint tensor `key`. Every stage reads the
    embedding (the first for its input, the last for the MTP head and a tied LM head)."""
    m = _LAYER_KEY.match(key)
    if m:
        return int(m.group(1)) in layers
    if key.startswith(("mtp.", "lm_head.", "model.norm.")) or key == "d2t":
        return last
    return True


FP8_MODES = ("keep", "dequantize")


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")
# what a checkpoint directory needs (config, weights, their index, tokenizer, chat template);
# a repository's README, images, other weight formats are not downloaded
HUB_FILES = ["*.json", "*.safetensors", "*.jinja"]
HUB_SKIP = ["*/*"]  # (the patterns' * matches "/": the checkpoint is the top folder, not other formats' subfolders)


def is_hub_id(raw: str) -> bool:
    """Whether `raw` reads as a Hugging Face model id, `org/name` or `org/name@revision`."""
    return bool(_HUB_ID.fullmatch(raw)) and ".." not in raw  # (match took "org/name\n": $ matches before a last \n)


def _snapshot_gap(path: Path) -> str | None:
    """What a cached snapshot lacks to hold a checkpoint (None: nothing): config.json, the
    shards its index names, or some *.safetensors without an index."""
    if not (path / "config.json").is_file():
        return "lacks config.json"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
            missing = sorted(s for s in shards if not (path / s).is_file())
        except (OSError, ValueError, AttributeError, TypeError):
            return "has an unreadable model.safetensors.index.json"
        if not shards:
            return "has a model.safetensors.index.json that names no shard"
        if missing:
            return (f"lacks {len(missing)} of the {len(shards)} shard(s) its model.safetensors.index.json names "
                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
        return None
    return None if any(path.glob("*.safetensors")) else "lacks *.safetensors weights"


def _complete_snapshot(path: Path) -> bool:
    """Whether a cached snapshot holds a checkpoint (see _snapshot_gap) with its tokenizer: a
    cache filled by a weights-only download (a model loaded without its tokenizer, `hf download
    ID --include "*.safetensors" config.json`) would otherwise be used as it is, never completed,
    and load with no tokenizer and no chat template. (After a download, a repository without a
    tokenizer.json is taken as it is: resolve_model_dir.)"""
    return _snapshot_gap(path) is None and (path / "tokenizer.json").is_file()


def resolve_model_dir(path: str | Path) -> Path:
    """A checkpoint directory from what a user gave: a path (a user's ~ expanded), or, when
    a str names no existing path, a Hugging Face model id (`org/name`, `org/name@revision`), whose
    snapshot huggingface_hub takes from its cache (HF_HUB_CACHE, default
    ~/.cache/huggingface/hub) or downloads there (config, *.safetensors, tokenizer and
    template files; HF_HUB_OFFLINE=1: the cache only; HF_TOKEN for a gated model).
    CheckpointError naming the id and why when it can be neither."""
    raw = os.fsdecode(path)  # (any os.PathLike by its path, as Path() takes it: str() of an os.DirEntry is its repr)
    p = Path(raw).expanduser()
    if not isinstance(path, str) or p.exists() or not is_hub_id(raw):  # (a Path is a path: a resolved one too)
        return p
    repo, _, revision = raw.partition("@")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # (tokenizers needs it, so it is there; a broken install may still lack it)
        raise CheckpointError(f"model directory {raw} does not exist; as a Hugging Face model id it needs the "
                              f"huggingface_hub package (pip install huggingface_hub)") from None
    try:  # a complete snapshot in the cache is used as it is, without asking the Hub (`hf download` updates it)
        got = Path(snapshot_download(repo, revision=revision or None, allow_patterns=HUB_FILES,
                                     ignore_patterns=HUB_SKIP, local_files_only=True))
        if _complete_snapshot(got):
            return got
    except Exception:  # noqa: BLE001 - not cached (or not wholly): downloaded below
        pass
    try:
        got = snapshot_download(repo, revision=revision or None, allow_patterns=HUB_FILES, ignore_patterns=HUB_SKIP)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one line naming it
        first = (str(e).strip().splitlines() or [""])[0].strip()
        why = f"{type(e).__name__}: {first}" if first else type(e).__name__
        raise CheckpointError(f"model directory {raw} does not exist, and as a Hugging Face model id it is neither "
                              f"in the local cache nor could it be downloaded ({why})") from None
    got = Path(got)
    gap = _snapshot_gap(got)
    if gap is not None:  # (offline or with the Hub out of reach, a partial cache comes back as it is; or a repo
        # without safetensors): what is missing named, not a guess at why
        raise CheckpointError(f"Hugging Face model {raw}: its snapshot {got} {gap} (hyspec reads safetensors "
                              f"checkpoints; a partial download is completed only when the Hub can be reached and "
                              f"HF_HUB_OFFLINE is not set)")
    return got


# the files of a checkpoint directory hyspec reads (besides *.safetensors)
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
                    "tokenizer_config.json", "chat_template.jinja")


def _check_files(path: Path) -> None:
    """A CheckpointError naming a checkpoint file that is a broken symbolic link (in huggingface_hub's
    cache layout, a snapshot's link to a blob that is gone: read as "no config.json", "no
    tokenizer.json", "No such file or directory") or a *.safetensors that is a folder (read as
    "No such device (os error 19)", or, in a shard index, as a shard that "does not exist")."""
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:  # (a folder that cannot be listed: its files are opened by name, as they were)
        return
    for e in entries:
        if e.name not in CHECKPOINT_FILES and not e.name.endswith(".safetensors"):
            continue
        if e.is_symlink() and not os.path.exists(e.path):
            raise CheckpointError(f"{e.path} is a broken symbolic link (to {os.readlink(e.path)}): the file it "
                                  f"points to is missing (an incomplete or pruned download?)")
        if e.name.endswith(".safetensors") and e.is_dir():
            raise CheckpointError(f"{e.path} is a directory, not a safetensors file")


def check_model_dir(path: str | Path) -> Path:
    """`path` as a Path when it is a directory (a Hugging Face model id resolved to its cached
    snapshot: resolve_model_dir), else a CheckpointError naming what it is."""
    path = resolve_model_dir(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"model path {path} is a file, not a directory: give the checkpoint directory "
                              f"(config.json + *.safetensors)")
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} does not exist")
    _check_files(path)
    return path


def load_model(path: str | Path, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu",
               load_mtp: bool = True, layers: range | None = None, fp8: str | None = None,
               ssm_dtype: str | None = None) -> HybridLM:
    """Build HybridLM from a checkpoint directory. Raises ConfigError / CheckpointError
    naming the field, key or shape at fault.

    layers: build one pipeline stage (hyspec/parallel): only these decoder layers' weights
    are read; the stage that ends at the last layer also gets the final norm, LM head and
    MTP head; other layers are empty placeholders (model.stage_layers = layers).

    fp8: what an FP8 block-quantized checkpoint becomes. "dequantize": every weight in
    `dtype` (the CPU reference's choice). "keep": quantized weights stay float8_e4m3fn on
    the device with their ``*_scale_inv`` grids (hyspec.quant.keep_fp8_params; about half
    the bytes): the model's torch forward dequantizes them on the fly, the Triton runner
    streams them. Default (None): keep on CUDA, dequantize elsewhere.

    ssm_dtype: the Gated DeltaNet state's storage dtype ("float32", "bfloat16", "float16";
    None or "auto": config.json's `mamba_ssm_dtype`, else fp32). bfloat16 halves the state's
    bytes (more sequence slots; no faster on the H200: docs/models.md) and rounds it after
    every token: the output then differs from an fp32 state's, not between plain and
    speculative decoding."""
    path = check_model_dir(path)
    dtype = parse_dtype(dtype, device)
    if fp8 is not None and fp8 not in FP8_MODES:
        raise ValueError(f"fp8 must be one of {', '.join(FP8_MODES)}, got {fp8!r}")
    if fp8 is None:
        fp8 = "keep" if torch.device(device).type == "cuda" else "dequantize"
    cfg = with_ssm_dtype(ModelConfig.from_dir(path), ssm_dtype)
    # FP8 checkpoints: dequantized here (fp32 product, cast to `dtype`), on the CPU, or kept in
    # float8 with their scales (fp8="keep"): the device only ever holds the model's one copy
    last = True
    keep = None
    seen: set[int] = set()  # a pipeline stage's keep(): the layers the checkpoint's keys name
    if layers is not None:
        if not (0 <= layers.start < layers.stop <= cfg.num_hidden_layers) or layers.step != 1:
            raise ValueError(f"stage layers {layers} are not a contiguous range of 0..{cfg.num_hidden_layers - 1}")
        last = layers.stop == cfg.num_hidden_layers
        load_mtp = load_mtp and last

        def keep(k: str) -> bool:  # (every layer a key names is seen, read or not: the count is checked below)
            m = _LAYER_KEY.match(k)
            if m:
                seen.add(int(m.group(1)))
            return stage_keeps(k, layers, last)
    qcfg = _quant_config(path) if fp8 == "keep" else None
    if qcfg is not None:
        from hyspec.quant import prepare_fp8

        tensors = prepare_fp8(read_tensors(path, dequantize=False, keep=keep), qcfg)
    else:
        tensors = read_tensors(path, dtype=dtype, keep=keep)
    # a config.json with fewer or more layers than the weights hold: not run cut short (also by
    # a pipeline stage, which reads only its own layers but sees every layer's keys)
    # (more layers in config.json than in the weights: named here, before a model of
    # 10,000,000 layers is built to list their missing tensors)
    found = seen if layers is not None else {int(m.group(1)) for k in tensors for m in [_LAYER_KEY.match(k)] if m}
    if found and max(found) + 1 != cfg.num_hidden_layers:
        raise CheckpointError(f"config.json has num_hidden_layers={cfg.num_hidden_layers} but the checkpoint "
                              f"{path} holds weights of {max(found) + 1} layers (model.layers.0 .. "
                              f"model.layers.{max(found)}): config.json and the weights disagree")
    has_mtp = load_mtp and any(k.startswith("mtp.") for k in tensors)
    with torch.device("meta"):
        model = HybridLM(cfg, with_mtp=has_mtp)
        if layers is not None:
            for i in range(cfg.num_hidden_layers):
                if i not in layers:
                    model.model.layers[i] = torch.nn.Module()  # another stage's layer: no weights here
            if not last:
                model.model.norm = torch.nn.Module()
                if not cfg.tie_word_embeddings:
                    del model.lm_head
            model.stage_layers = layers
    model = cast_params(model, dtype)
    kept = _keep_fp8(model, tensors, qcfg) if qcfg is not None else []

    # every weight checked against config.json's shapes on the meta model, before any memory is
    # taken (a config.json with an absurd size fails here, not in the allocator)
    sources = {}
    missing = [k for k, _ in model.named_parameters() if k not in tensors]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {path} is missing tensor(s) {', '.join(repr(m) for m in missing[:5])}{more}")
    for name, p in model.named_parameters():
        src = tensors[name]
        if tuple(src.shape) != tuple(p.shape):
            # stacked experts are sometimes stored transposed ([E, H, 2I] / [E, I, H])
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and \
                    tuple(src.shape) == (p.shape[0], p.shape[2], p.shape[1]):
                src = src.transpose(1, 2)
            else:
                raise CheckpointError(f"tensor '{name}' has shape {list(src.shape)}, expected {list(p.shape)} "
                                      f"from config.json")
        if not (src.is_floating_point() or name in kept):
            raise CheckpointError(f"tensor '{name}' is stored as {src.dtype}; a weight must be a floating-point "
                                  f"tensor")
        sources[name] = src
    consumed = {n + sfx for n in kept for sfx in ("_scale_inv", "_scale_rows")}
    unused = [k for k in tensors if k not in ("mtp.d2t", "d2t") and k not in sources and k not in consumed and not (k == "lm_head.weight" and cfg.tie_word_embeddings)
              and not (k.startswith("mtp.") and not has_mtp) and not _LATER_MTP_LAYER.match(k)]
    undescribed = [k for k in unused if k.startswith("model.layers.") and not k.endswith("inv_freq")]
    if undescribed:  # a layer's weights the model does not have: config.json switched a part off
        raise CheckpointError(f"checkpoint {path} has {len(undescribed)} layer weight(s) that config.json does not "
                              f"describe, e.g. {undescribed[:3]}: config.json and the weights disagree (a part "
                              f"the weights have is switched off or sized 0 in config.json)")
    if unused:
        warnings.warn(f"ignoring {len(unused)} unexpected tensor(s), e.g. {unused[:3]}", stacklevel=2)
    # (warned once the weights are known to fit: not before an error)
    if has_mtp and cfg.mtp_num_hidden_layers > 1:
        warnings.warn(f"{path}: config.json has mtp_num_hidden_layers={cfg.mtp_num_hidden_layers}; hyspec drafts "
                      f"with the first MTP layer (mtp.layers.0) only, chained for every draft", stacklevel=2)
    if load_mtp and not has_mtp and cfg.mtp_num_hidden_layers > 0:
        warnings.warn(f"{path}: config.json has mtp_num_hidden_layers={cfg.mtp_num_hidden_layers} but the weights "
                      f"have no mtp.* tensors: speculative decoding (--draft K) is unavailable, plain decoding "
                      f"works", stacklevel=2)
    model = model.to_empty(device=device)

    expected = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in expected.items():
            p.copy_(sources[name].to(p.dtype))
        for name in kept:  # the kept fp8 weights' scale grids (and row maps)
            mod_name, _, attr = name.rpartition(".")
            mod = model.get_submodule(mod_name)
            for suffix in ("_scale_inv", "_scale_rows"):
                if attr + suffix in mod._buffers:
                    mod._buffers[attr + suffix].copy_(tensors[name + suffix])
        for name, p in expected.items():  # a NaN or inf weight would decode garbage without a word
            if name in kept:
                # float8_e4m3fn has no inf; its NaN codes are 0x7f / 0xff (torch has no isfinite for float8);
                # in 64M-byte pieces (a whole 1 GiB expert stack took two 1 GiB temporaries on the GPU)
                raw = p.view(torch.uint8).reshape(-1)
                if any(bool(((raw[i: i + (1 << 26)] & 0x7F) == 0x7F).any()) for i in range(0, raw.numel(), 1 << 26)):
                    raise CheckpointError(f"tensor '{name}' holds NaN or infinite values: the checkpoint is damaged")
                mod, attr = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
                p = getattr(mod, attr + "_scale_inv")
                from hyspec.quant import check_scale_signs

                check_scale_signs(name, p)
                if dtype == torch.float16 and bool(torch.isfinite(p).all()):
                    # the torch forward dequantizes it into float16 (hyspec.quant.module_weight): refused here,
                    # named, as a dequantizing load refuses it (it failed at the first forward, unnamed)
                    from hyspec.quant import module_fp8

                    big = module_fp8(mod, attr).abs_max()
                    if bool(torch.tensor(big).to(torch.float16).isinf()):  # (as a dequantizing load's cast)
                        raise CheckpointError(f"tensor '{name}' dequantizes to values up to {big:.4g}, beyond the "
                                              f"range of {dtype} it is loaded in: load it in bfloat16 or float32 "
                                              f"(--dtype)")
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                src = sources.get(name)
                if name not in kept and src is not None and src.is_floating_point() and bool(torch.isfinite(src).all()):
                    big = float(src.abs().max())  # finite in the file, not in the load dtype (fp16: max 65504)
                    raise CheckpointError(f"tensor '{name}' holds values up to {big:.4g}, beyond the range of "
                                          f"{p.dtype} it is loaded in: load it in bfloat16 or float32 (--dtype)")
                raise CheckpointError(f"tensor '{name}'{' (its block scales)' if name in kept else ''} holds NaN or "
                                      f"infinite values: the checkpoint is damaged")
    d2t = tensors.get("mtp.d2t", tensors.get("d2t"))
    if d2t is not None and has_mtp:
        if d2t.dim() != 1 or d2t.numel() == 0 or d2t.is_floating_point() or d2t.dtype == torch.bool:
            raise CheckpointError(f"tensor 'mtp.d2t' must be a non-empty 1-D integer tensor of offsets, got "
                                  f"{d2t.dtype} of shape {list(d2t.shape)}")
        ids = torch.arange(d2t.shape[0]) + d2t.to(torch.long)
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise CheckpointError(f"tensor 'mtp.d2t' must map draft ids to target ids in 0..{cfg.vocab_size - 1} "
                                  f"(EAGLE offsets: target = i + d2t[i]); got shape {list(d2t.shape)}")
        model.d2t = d2t.to(device=device, dtype=torch.long)
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if cfg.tie_word_embeddings and head is not None and embed is not None and not (
            head.shape == embed.shape and head.dtype == embed.dtype and torch.equal(head, embed)):
        warnings.warn(f"{path}: config.json ties the LM head to the embedding (tie_word_embeddings), but the "
                      f"checkpoint's lm_head.weight differs from it: the embedding is used", stacklevel=2)
    model.eval()
    model.requires_grad_(False)
    return model


__all__ = ["load_model", "read_tensors", "CheckpointError", "ConfigError", "parse_dtype", "DTYPES", "cast_params"]
