"""A base model's transformers config, whatever name its checkpoint gives its architecture.

Job: read `config.json` as the family it is. Some checkpoints name their own model type for an
architecture transformers ships under another (Kimi-K2 and Kimi-K2-Thinking: `kimi_k2`, the
DeepSeek-V3 architecture, docs/compatibility.md); transformers has no class for that name, so
`AutoConfig` alone refuses them. Everything that builds or inspects the base model reads its
config here.
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

# Model types whose checkpoints are another family's architecture under their own name, with no
# transformers class of their own: Kimi-K2 (Thinking) is DeepSeek-V3.
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


def load_config(base_model: str) -> PretrainedConfig:
    """`base_model`'s config, a model type of `MODEL_TYPE_ALIASES` read as the family it is."""
    raw, _ = PretrainedConfig.get_config_dict(base_model)
    alias = MODEL_TYPE_ALIASES.get(str(raw.get("model_type")))
    if alias is None:
        config: PretrainedConfig = AutoConfig.from_pretrained(base_model)
        return config
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "auto_map")}
    aliased: PretrainedConfig = AutoConfig.for_model(alias, **fields)
    return aliased
