"""ModelArgs: the DeepSeek-V4 config.json (HF and legacy keys), validated once."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

_TYPE_TO_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


@dataclass
class ModelArgs:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    # One entry per decoder layer: 0 sliding only, 4 CSA, 128 HCA (the MTP entry is dropped).
    compress_ratios: list[int] = field(default_factory=lambda: [0, 0] + [4, 128] * 20 + [4])
    compress_rope_theta: float = 160000.0
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = field(
        default_factory=lambda: {
            "type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        }
    )
    max_position_embeddings: int = 1048576
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    num_hash_layers: int = 3
    swiglu_limit: float = 10.0
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    quantization_config: dict[str, Any] | None = None
    # MTP blocks (`mtp.0.*`, model/mtp.py): every V4 release ships one; 0 or 1 here (the loader sets 0 for a
    # checkpoint without them).
    num_nextn_predict_layers: int = 1
    # Not in config.json: the reference leaves the shared expert unclamped, transformers clamps it.
    clamp_shared_expert: bool = False

    # ---- derived ----------------------------------------------------------------------------
    def layer_ratio(self, layer: int) -> int:
        """Layers past num_hidden_layers are the MTP blocks': sliding only (their compress_ratios entries are 0)."""
        return self.compress_ratios[layer] if layer < self.num_hidden_layers else 0

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def yarn(self) -> dict[str, Any] | None:
        rs = self.rope_scaling
        if not rs or rs.get("type", rs.get("rope_type")) != "yarn":
            return None
        return rs

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelArgs:
        cfg = dict(cfg)
        n = cfg.get("num_hidden_layers", cls.num_hidden_layers)
        if "compress_ratios" in cfg:
            ratios = list(cfg.pop("compress_ratios"))
            if len(ratios) < n:
                raise ValueError(f"config key 'compress_ratios' has {len(ratios)} entries, need {n}")
            cfg["compress_ratios"] = [int(r) for r in ratios[:n]]  # trailing entries: MTP layers
            mtp = ratios[n : n + int(cfg.get("num_nextn_predict_layers", cls.num_nextn_predict_layers) or 0)]
            if any(int(r) for r in mtp):  # REF builds the MTP block's attention from its entry
                raise ValueError(f"config key 'compress_ratios': the MTP layers' entries {mtp} must be 0 "
                                 "(sliding window only; a compressed MTP layer is not supported)")
        elif "layer_types" in cfg:
            try:
                cfg["compress_ratios"] = [_TYPE_TO_RATIO[t] for t in cfg["layer_types"]]
            except KeyError as e:
                raise ValueError(f"config key 'layer_types' has unknown entry {e.args[0]!r}") from None
        if "mlp_layer_types" in cfg and "num_hash_layers" not in cfg:
            cfg["num_hash_layers"] = sum(1 for t in cfg["mlp_layer_types"] if t == "hash_moe")
        if "rope_scaling" not in cfg and isinstance(cfg.get("rope_parameters"), dict):
            comp = cfg["rope_parameters"].get("compress")
            if isinstance(comp, dict):
                cfg["rope_scaling"] = comp
                cfg.setdefault("compress_rope_theta", comp.get("rope_theta", cls.compress_rope_theta))
        if "qk_rope_head_dim" not in cfg and cfg.get("partial_rotary_factor"):
            cfg["qk_rope_head_dim"] = int(round(cfg["partial_rotary_factor"] * cfg.get("head_dim", 512)))
        if isinstance(cfg.get("eos_token_id"), list):
            cfg["eos_token_id"] = cfg["eos_token_id"][0]
        known = {f.name for f in fields(cls)}
        args = cls(**{k: v for k, v in cfg.items() if k in known})
        args.validate()
        return args

    @classmethod
    def from_file(cls, path: str | Path) -> ModelArgs:
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"config.json not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"config.json is not valid JSON: {path}: {e}") from None
        return cls.from_dict(cfg)

    def to_config_json(self) -> dict[str, Any]:
        """The legacy (release) spelling, which transformers folds into its own keys."""
        d = asdict(self)
        d.pop("clamp_shared_expert")
        if d["quantization_config"] is None:
            d.pop("quantization_config")
        # trailing MTP slots, as released (one even without the block, as this writer always wrote)
        d["compress_ratios"] = list(self.compress_ratios) + [0] * max(1, self.num_nextn_predict_layers)
        d["model_type"] = "deepseek_v4"
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        d["torch_dtype"] = "float32"
        return d

    @classmethod
    def tiny(cls) -> ModelArgs:
        """The spec's tiny config (section 6): every path in well under a second per step on a CPU."""
        return cls(
            vocab_size=512,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            qk_rope_head_dim=8,
            q_lora_rank=32,
            o_groups=2,
            o_lora_rank=16,
            sliding_window=8,
            compress_ratios=[0, 4, 128, 4],
            rope_scaling={
                "type": "yarn",
                "factor": 16.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            # 8,192 positions: room for a tools prompt (~830 tiny tokens) and a long answer, so every API feature
            # can be tried on it. YaRN's factor stays 16 (the tiny model's numerics below 1,024 as before).
            max_position_embeddings=8192,
            index_n_heads=32,
            index_head_dim=16,
            index_topk=4,
            hc_mult=2,
            hc_sinkhorn_iters=5,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=32,
            num_hash_layers=2,
        )

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> None:
        def bad(key: str, why: str) -> ValueError:
            return ValueError(f"config key '{key}' {why}")

        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                    "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
                    "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "n_routed_experts",
                    "num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(key, f"must be a positive integer, got {v!r}")
        if len(self.compress_ratios) != self.num_hidden_layers:
            raise bad("compress_ratios", f"has {len(self.compress_ratios)} entries for "
                      f"{self.num_hidden_layers} layers")
        if any(r not in (0, 4, 128) for r in self.compress_ratios):
            raise bad("compress_ratios", f"entries must be 0, 4 or 128, got {self.compress_ratios}")
        if self.num_key_value_heads != 1:
            raise bad("num_key_value_heads", f"must be 1 (shared K=V MQA), got {self.num_key_value_heads}")
        rd = self.qk_rope_head_dim
        if rd <= 0 or rd % 2 or rd > self.head_dim:
            raise bad("qk_rope_head_dim", f"must be even and in 2..head_dim, got {rd}")
        if self.index_head_dim < rd:
            raise bad("index_head_dim", f"must be >= qk_rope_head_dim ({rd}), got {self.index_head_dim}")
        if (self.num_attention_heads * self.head_dim) % self.o_groups or self.num_attention_heads % self.o_groups:
            raise bad("o_groups", f"must divide num_attention_heads ({self.num_attention_heads})")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise bad("num_experts_per_tok", "must not exceed n_routed_experts")
        if self.n_shared_experts != 1:
            raise bad("n_shared_experts", f"must be 1, got {self.n_shared_experts}")
        if self.sliding_window < 2:
            raise bad("sliding_window", f"must be >= 2, got {self.sliding_window}")
        if self.scoring_func != "sqrtsoftplus":
            raise bad("scoring_func", f"must be 'sqrtsoftplus', got {self.scoring_func!r}")
        if self.num_nextn_predict_layers not in (0, 1):
            raise bad("num_nextn_predict_layers", f"must be 0 or 1, got {self.num_nextn_predict_layers!r}")
        if not 0 <= self.num_hash_layers <= self.num_hidden_layers:
            raise bad("num_hash_layers", f"must be in 0..num_hidden_layers, got {self.num_hash_layers}")
        for key in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise bad(key, f"must be a finite positive number, got {v!r}")
        if self.yarn is not None:
            for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
                if key not in self.yarn:
                    raise bad("rope_scaling", f"(yarn) is missing {key!r}")
