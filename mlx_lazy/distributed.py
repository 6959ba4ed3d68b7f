"""Tensor parallelism over ``mx.distributed``: the model sharded with mlx-lm's own
``model.shard(group)``, the same pruning decisions on every rank.

Launched with ``mlx.launch`` (ring, MPI, ...), every rank loads the model and keeps its share
of the attention heads and of the MLP; mlx-lm all-sums the outputs of ``o_proj`` and
``down_proj``, so the hidden states and logits are the same on every rank. What is not the
same is anything computed from one rank's heads alone: LazyLLM's selection scores. The
engine all-sums them (:meth:`TensorParallel.reduce_heads`), so every rank keeps the same
tokens and its cache, Aux Cache and depths stay in step with the others'. The sampled token
is taken from rank 0 (:func:`from_rank0`), so stops agree too.

Start-up runs in :func:`together` blocks: every rank reports whether its part failed, and
what it loaded or was given (digests of the model files, the prompt, the pruning schedule,
the generation options), in one small all-gather; then every rank raises the same error,
or none.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Type

import mlx.core as mx
import mlx.nn as nn

from .adapter import (LONGCAT_TYPES, ModelAdapter, attention_module, config_value, feed_forward,
                      kv_heads, model_family, recurrent_layers, text_args)
from .errors import UserInputError

Group = mx.distributed.Group


class RankFailed(RuntimeError):
    """Another rank failed with an internal error (its traceback is on its own stderr)."""


def world() -> Optional[Group]:
    """The group of every rank when the process was launched with more than one rank
    (``mlx.launch``), else None."""
    if not mx.distributed.is_available():
        return None
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile and os.path.isfile(hostfile) and not open(hostfile).read().strip():
        return None  # ``mlx.launch -n 1`` writes an empty ring hostfile: one process
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def is_rank0(group: Optional[Group]) -> bool:
    """True for rank 0 of ``group`` and for a single process (None)."""
    return group is None or group.rank() == 0


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a distributed backend's error for a rank that went away."""
    return (isinstance(exc, RuntimeError)
            and re.match(r"\[(ring|mpi|jaccl|nccl)\]", str(exc)) is not None)


def barrier(group: Optional[Group]) -> None:
    """Wait until every rank of ``group`` gets here; return at once if one is gone."""
    if group is None:
        return
    try:
        mx.eval(mx.distributed.all_sum(mx.array(1), group=group, stream=mx.cpu))
    except RuntimeError:
        pass


# ------------------------------------------------------------------ sharding
_SHARDED_TO_ALL = (nn.ShardedToAllLinear, nn.QuantizedShardedToAllLinear)


def shard(model: nn.Module, group: Group) -> None:
    """Split ``model`` over ``group`` with mlx-lm's ``model.shard(group)`` (a vision-language
    checkpoint without one: its text model's), after checking that it can be split evenly, and
    count the bytes its all-sums move (:func:`allsum_counter`).

    Raises:
        UserInputError: an architecture mlx-lazy or mlx-lm cannot shard, or head counts or
            MLP width not divisible by the number of ranks.
    """
    n = group.size()
    adapter = ModelAdapter(model)  # unsupported architectures fail here, before any sharding
    family = model_family(model.model_type)  # (Kimi K2's: DeepSeek-V3's)
    sharder = SHARDERS.get(family)
    # a VL checkpoint without a shard of its own (Qwen2/3-VL's): its text model's
    own = getattr(model, "shard", None) or getattr(adapter.text, "shard", None)
    if sharder is None and own is None:
        raise UserInputError(f"mlx-lm cannot shard {model.model_type!r} models over ranks")
    if recurrent_layers(model):
        raise UserInputError(f"mlx-lazy cannot shard {model.model_type!r} models over ranks: "
                             "their linear-attention layers are not split here")
    if family in LONGCAT_TYPES:  # mlx-lm's shard splits them; the engine's blocks
        # are half of one (mlx_lazy.adapter._sublayer), whose heads and group it reads otherwise
        raise UserInputError(f"mlx-lazy cannot shard {model.model_type!r} models over ranks: "
                             "their blocks' two attentions and shortcut MoE are not split here")
    if family == "muse_spark":  # mlx-lm's shard splits the head, gathered in its own forward
        raise UserInputError(f"mlx-lazy cannot shard {model.model_type!r} models over ranks: "
                             "their head and experts, as mlx-lm splits them, are not run here")
    # mlx-lm's shard() only divides: uneven splits must be refused here
    args = text_args(adapter.text)  # gemma3: its text model's
    sizes = {"attention heads": config_value(args, "num_attention_heads"),
             "key/value heads": kv_heads(args),
             "MLP width": config_value(args, "intermediate_size",  # GPT-2's: 4 x hidden
                                       4 * config_value(args, "hidden_size"))
             // (2 if family == "qwen" else 1)}  # Qwen 1's: half its intermediate_size
    if getattr(args, "moe_intermediate_size", None):
        sizes["expert MLP width"] = args.moe_intermediate_size
    if getattr(args, "index_n_heads", None):  # MiniMax-M3's sparse layers' indexer
        sizes["indexer heads"] = args.index_n_heads
    other = getattr(args, "attention_other_setting", None)  # Step-3.5's sliding-window layers'
    if other:
        sizes["sliding-window attention heads"] = other["num_attention_heads"]
        sizes["sliding-window key/value heads"] = other["num_attention_groups"]
    for what, size in sizes.items():
        if size % n:
            raise UserInputError(
                f"the model's {size} {what} cannot be split evenly over {n} ranks; "
                f"launch a number of ranks that divides {size}"
            )
    if sharder is not None:
        sharder(adapter.layers, group)
    else:
        own(group)
    counter = AllSumCounter()
    model._mlx_lazy_allsums = counter
    for module in model.modules():
        if isinstance(module, _SHARDED_TO_ALL):
            module.__class__ = _counting(type(module))
            module._mlx_lazy_allsums = counter


def shard_by_heads(layers: List[nn.Module], group: Group) -> None:
    """Split a model's transformer ``layers`` over ``group`` the way mlx-lm's own ``shard``
    splits Llama, for the models whose mlx-lm module lacks it (Gemma 3 and the text model of
    a ``gemma3`` checkpoint, SmolLM3, Granite, the text model of a ``mistral3`` checkpoint,
    EXAONE 4, Seed-OSS, ERNIE 4.5's dense models, Gemma 2, Command R7B, Helium, InternLM3,
    StarCoder2, Hunyuan dense, MiniCPM, MiMo, EXAONE 3, StableLM, nanochat, Gemma 1,
    Command R, Phi-2, GPT-NeoX, InternLM2, Qwen 1, GPT-2, Nemotron, Nanbeige, GLM-4-9B,
    GLM-4-0414, TeleChat 3, GPT-J: each block split
    once, though a looped model's ``layers`` name it once per loop; and the latent attention
    of MiniCPM3 and Youtu-LLM: each rank its heads' q_b_proj and kv_b_proj rows):
    q/k/v and gate/up projections by output rows (each rank its heads, its share of the MLP;
    of a fused ``gate_up_proj``, its share of each half),
    o_proj and down_proj by input columns with an all-sum (a bias added once, after it).
    Gemma's, EXAONE 4's and Hunyuan's q/k norms act per head (head_dim wide) and their other
    norms on the whole hidden state after the all-sums, so they stay whole; so do the
    embedding and the tied head; StableLM's per-head LayerNorms (one module per head) and
    Command R+'s (one weight row per head) are split with their heads; GPT-NeoX's fused
    ``query_key_value`` holds each head's q, k and v together, so its rows split by head too.
    (OLMo's q/k norms span all heads: not split this way.) Other fused q/k/v projections split
    as their rows lie: InternLM2's ``wqkv`` (each key/value head's queries, key and value
    together) in one piece per rank, Qwen 1's ``c_attn`` (all queries, then keys, then
    values) each third apart."""
    from mlx.nn.layers.distributed import shard_linear

    n = group.size()
    for layer in {id(layer): layer for layer in layers}.values():  # Nanbeige's: once per loop
        attn, mlp = attention_module(layer), feed_forward(layer)
        # projections as each family names them: EXAONE 3's out_proj, nanochat's c_*,
        # InternLM2's wqkv/wo, Qwen 1's c_attn (three segments), phi's and gpt_neox's dense;
        # q_b_proj, kv_b_proj: latent attention's per-head projections (the latent stays whole)
        for name in ("q_proj", "k_proj", "v_proj", "c_q", "c_k", "c_v", "query_key_value",
                     "wqkv", "c_attn", "q_b_proj", "kv_b_proj"):
            if name in attn:
                setattr(attn, name, shard_linear(attn[name], "all-to-sharded", group=group,
                                                 segments=3 if name == "c_attn" else 1))
        for name in ("o_proj", "out_proj", "c_proj", "dense", "wo"):
            if name in attn:
                setattr(attn, name, shard_linear(attn[name], "sharded-to-all", group=group))
        for name in ("n_heads", "n_kv_heads", "num_heads", "num_key_value_heads",
                     "num_kv_heads", "num_attention_heads", "n_head"):  # MiniCPM's,
            # StableLM's, nanochat's, GPT-NeoX's, Qwen 1's named num_*, GPT-2's n_head
            if hasattr(attn, name):
                setattr(attn, name, getattr(attn, name) // n)
        for name in ("q_layernorm", "k_layernorm"):  # StableLM's, one LayerNorm per head:
            if name in attn:  # each rank keeps its heads'
                norms = attn[name].norms
                share = len(norms) // n
                attn[name].norms = norms[group.rank() * share:(group.rank() + 1) * share]
        for name in ("q_norm", "k_norm"):  # Command R+'s LayerNorm2D: a weight row per head
            norm = attn.get(name)
            if norm is not None and norm.weight.ndim == 2:
                share = norm.weight.shape[0] // n
                norm.weight = norm.weight[group.rank() * share:(group.rank() + 1) * share]
        # c_fc, c_proj: StarCoder2's and nanochat's plain MLP; c_fc_0, c_fc_1: EXAONE 3's;
        # fc1, fc2: Phi-2's; fc_in, fc_out: GPT-J's; dense_h_to_4h, dense_4h_to_h: GPT-NeoX's;
        # w1, w3, w2: InternLM2's gate, up, down; w1, w2, c_proj: Qwen 1's up, gate, down
        downs = ("down_proj", "c_proj", "fc2", "fc_out", "dense_4h_to_h",
                 *(("w2",) if "w3" in mlp else ()))
        for name in ("gate_proj", "up_proj", "c_fc", "c_fc_0", "c_fc_1", "fc1", "fc_in",
                     "dense_h_to_4h", "w1", "w2", "w3",
                     "gate_up_proj"):  # GLM-4-9B's fused gate, then up
            if name in mlp and name not in downs:
                setattr(mlp, name, shard_linear(getattr(mlp, name), "all-to-sharded", group=group,
                                                segments=2 if name == "gate_up_proj" else 1))
        for name in downs:
            if name in mlp:
                setattr(mlp, name, shard_linear(getattr(mlp, name), "sharded-to-all", group=group))


#: Sharders for model types whose mlx-lm module has no ``shard`` method.
SHARDERS = {kind: shard_by_heads for kind in
            ("ernie4_5", "exaone4", "gemma3", "gemma3_text", "granite", "mistral3", "seed_oss",
             "smollm3", "gemma2", "cohere2", "helium", "internlm3", "starcoder2",
             "hunyuan_v1_dense", "minicpm", "mimo", "exaone", "stablelm", "nanochat", "gemma",
             "cohere", "phi", "gpt_neox", "internlm2", "qwen", "gpt2", "nemotron", "nanbeige",
             "minicpm3", "youtu_llm", "glm", "telechat3", "glm4", "gptj")}


def model_group(model: nn.Module) -> Optional[Group]:
    """The group a model was sharded over by :func:`shard`, or None."""
    attn = next((attention_module(layer) for layer in model.layers
                 if any(name in layer for name in ("self_attn", "attention", "attn"))), None)
    # None: no attention, or an output projection never sharded (LFM2's out_proj, Ling's dense)
    o_proj = next((attn[name] for name in ("o_proj", "out_proj", "c_proj", "dense", "wo")
                   if attn is not None and name in attn), None)
    return o_proj.group if isinstance(o_proj, _SHARDED_TO_ALL) else None


class AllSumCounter:
    """The arrays all-summed by a sharded model's layers: count per size in bytes."""

    def __init__(self) -> None:
        self.by_size: Counter = Counter()

    @property
    def bytes(self) -> int:
        """Bytes of every array all-summed so far (each rank sends and receives
        2 (N - 1) / N of that over a ring)."""
        return sum(size * count for size, count in self.by_size.items())


def allsum_counter(model: nn.Module) -> Optional[AllSumCounter]:
    """The counter :func:`shard` attached to ``model``; None for an unsharded model."""
    return getattr(model, "_mlx_lazy_allsums", None)


_counting_classes: Dict[type, type] = {}


def _counting(cls: Type[nn.Module]) -> type:
    """``cls`` (a sharded-to-all linear layer) that also records the size of its output,
    which is exactly what it all-summed. Same parameters, same results."""
    if cls not in _counting_classes:

        def __call__(self, x: mx.array) -> mx.array:
            y = cls.__call__(self, x)
            self._mlx_lazy_allsums.by_size[y.nbytes] += 1
            return y

        _counting_classes[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _counting_classes[cls]


class TensorParallel:
    """What the engine needs from the group: the number of ranks, the reduction of
    per-rank scores, and byte counts.

    Args:
        model: the (sharded or not) model the engine runs.
        group: the group it is sharded over; None for a single process.
    """

    def __init__(self, model: nn.Module, group: Optional[Group]):
        self.group = group
        self.size = 1 if group is None else group.size()
        self._counter = allsum_counter(model)
        self._model_start = 0
        self.score_bytes = 0

    def restart(self) -> None:
        """Start counting bytes for a new generation."""
        self._model_start = self._counter.bytes if self._counter else 0
        self.score_bytes = 0

    @property
    def model_bytes(self) -> int:
        """Bytes all-summed by the model's layers since :meth:`restart`."""
        return self._counter.bytes - self._model_start if self._counter else 0

    def reduce_heads(self, local: mx.array, heads: str) -> mx.array:
        """A reduction over all heads of the model from each rank's reduction over its own:
        ``"mean"`` (every rank holds the same number of heads, so the global mean is the sum
        of the per-rank means divided by the rank count) or ``"max"``. The result is the same
        on every rank, so every rank ranks the candidates alike."""
        if self.group is None:
            return local
        self.score_bytes += local.nbytes
        if heads == "max":
            return mx.distributed.all_max(local, group=self.group)
        return mx.distributed.all_sum(local, group=self.group) / self.size


def from_rank0(x: mx.array, group: Optional[Group]) -> mx.array:
    """``x`` as rank 0 has it, on every rank (a sampled token: samplers draw from each
    rank's own random state)."""
    if group is None:
        return x
    mine = x if group.rank() == 0 else mx.zeros_like(x)
    return mx.distributed.all_sum(mine, group=group)


# ------------------------------------------------------------------ start-up
_RECORD = 1024  # bytes per rank: status, fingerprints, message
_MAX_FINGERPRINTS = 4
_OK, _USER, _INTERNAL = 0, 1, 2


def weights_digest(path: Path, sample: int = 1 << 16, samples: int = 16) -> bytes:
    """A digest of a model folder's config and weight files: names, sizes and ``samples``
    evenly spaced ``sample``-byte pieces of each (the safetensors header included), so that
    ranks can check in milliseconds that they loaded the same model, whatever its size.
    A single changed byte between samples goes unnoticed."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(path).iterdir()
                   if p.name == "config.json" or p.suffix == ".safetensors")
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with open(p, "rb") as f:
            for i in range(samples):
                f.seek(max(0, size - sample) * i // max(1, samples - 1))
                h.update(f.read(sample))
    return h.digest()


def digest(data: bytes) -> bytes:
    """sha256 of ``data``, for :func:`together`'s fingerprints."""
    return hashlib.sha256(data).digest()


def digest_of(value: Any) -> bytes:
    """:func:`digest` of a JSON-serialisable value (dict keys in any order)."""
    return digest(json.dumps(value, sort_keys=True).encode())


@contextmanager
def together(
    group: Optional[Group],
    user_errors: Tuple[Type[BaseException], ...] = (UserInputError,),
) -> Iterator[Dict[str, bytes]]:
    """Run a start-up step on every rank and end it on every rank alike.

    The block may put up to four 32-byte fingerprints (:func:`digest`,
    :func:`weights_digest`) in the dict it gets, e.g. ``same["model files"] = ...``. At the
    end each rank shares whether the block failed, its fingerprints and its error message
    (one all-gather of 1 KiB per rank). If a rank failed, every rank raises: the failing
    rank its own exception, the others a :class:`~mlx_lazy.errors.UserInputError` (for
    ``user_errors``) or :class:`RankFailed` naming the rank and its message; if rank 0
    failed, its error is the one reported. If all succeeded but a fingerprint differs,
    every rank raises a UserInputError naming it. With ``group`` None it only runs the block.
    """
    same: Dict[str, bytes] = {}
    if group is None:
        yield same
        return
    error: Optional[BaseException] = None
    try:
        yield same
    except Exception as e:
        error = e
    records = _exchange(group, error, same, user_errors)
    failed = [r for r, rec in enumerate(records) if rec[0] != _OK]
    if failed:
        if error is not None:  # rank 0 reports its own error, or the first failed rank's
            raise error
        k = failed[0]
        message = (bytes(records[k][1 + 32 * _MAX_FINGERPRINTS:]).rstrip(b"\0")
                   .decode(errors="replace"))
        if records[k][0] == _USER:
            raise UserInputError(f"rank {k}: {message}")
        raise RankFailed(f"rank {k} failed: {message}")
    for i, name in enumerate(same):
        ours = records[0][1 + 32 * i : 33 + 32 * i]
        for k, rec in enumerate(records[1:], start=1):
            theirs = rec[1 + 32 * i : 33 + 32 * i]
            if theirs != ours:
                raise UserInputError(
                    f"the {name} differ between rank 0 and rank {k} "
                    f"(digest {bytes(ours).hex()[:12]} vs {bytes(theirs).hex()[:12]})"
                )


def _exchange(group: Group, error: Optional[BaseException], same: Dict[str, bytes],
              user_errors: Tuple[Type[BaseException], ...]) -> list:
    """All-gather every rank's fixed-size record; return them as byte lists by rank."""
    if len(same) > _MAX_FINGERPRINTS or any(len(d) != 32 for d in same.values()):
        raise ValueError(f"together() takes at most {_MAX_FINGERPRINTS} 32-byte fingerprints")
    if error is None:
        status, message = _OK, ""
    elif isinstance(error, user_errors):
        status, message = _USER, " ".join(str(error).split()) or type(error).__name__
    else:
        status, message = _INTERNAL, f"{type(error).__name__}: {' '.join(str(error).split())}"
    record = bytearray(_RECORD)
    record[0] = status
    for i, d in enumerate(same.values()):
        record[1 + 32 * i : 33 + 32 * i] = d
    text = message.encode()[: _RECORD - 1 - 32 * _MAX_FINGERPRINTS]
    record[1 + 32 * _MAX_FINGERPRINTS : 1 + 32 * _MAX_FINGERPRINTS + len(text)] = text
    gathered = mx.distributed.all_gather(mx.array(list(record), mx.uint8), group=group,
                                         stream=mx.cpu)
    flat = gathered.tolist()
    return [flat[r * _RECORD : (r + 1) * _RECORD] for r in range(group.size())]
