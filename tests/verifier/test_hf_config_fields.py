"""Every field of each family's transformers config class is read as that class reads it, or refused by name.

The test walks each transformers config class's fields (``dataclasses.fields``: a field a new transformers release
adds fails here until it is classified) and holds the loader's ``ConfigSpec`` to them: the same fields with the
same defaults. Every field that changes the forward pass has cases: a value stree follows is loaded from a tiny
random transformers model and its logits must equal transformers' (1e-5, fp32); a value stree cannot run must be
refused with a ValueError naming the field. The fields a spec calls ignored are all changed at once, and the
logits must still equal transformers'. MambaInLlama's Llama half is checked against ``LlamaForCausalLM`` (a
checkpoint whose every layer is attention).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from dataclasses import dataclass

import pytest
import torch

from stree.verifier.model.checkpoint import load_model
from stree.verifier.model.hf import fields as hf_fields
from stree.verifier.model.hf.fields import CheckpointWarning
from stree.verifier.model.hf.registry import FAMILIES, resolve
from hf_helpers import TINY, build_tiny, hf_logits, save_tiny, tiny_kwargs, write_llama_as_mambainllama

transformers = pytest.importorskip("transformers")

SPECS = {model_type: family.SPEC for model_type, family in FAMILIES.items()}  # model types, as TINY's keys


@dataclass(frozen=True)
class Match:
    """stree follows ``over`` (logits equal to transformers'); loading warns only when ``warns`` matches."""

    over: dict
    warns: str | None = None


@dataclass(frozen=True)
class Refuse:
    """stree refuses ``over`` with a ValueError matching ``message`` (default: the field's name)."""

    over: dict
    message: str | None = None


ROPE = {"rope_type": "default", "rope_theta": 100.0}
YARN = {"rope_type": "yarn", "factor": 2.0}
LIMIT = [0.05, 0.2]  # the tiny models' dt (softplus of dt_bias in [-3, 0]) crosses both ends



def _decoder_cases(layers: int) -> dict:
    """Cases of the fields Bamba, Falcon-H1 and Llama read alike (sizes, norm eps, tying, attention biases)."""
    return {
        "vocab_size": [Match({"vocab_size": 50})],
        "tie_word_embeddings": [Match({"tie_word_embeddings": True})],
        "hidden_size": [Match({"hidden_size": 48})],
        "intermediate_size": [Match({"intermediate_size": 40})],
        "num_hidden_layers": [Match({"num_hidden_layers": layers})],
        "num_attention_heads": [Match({"num_attention_heads": 2, "num_key_value_heads": 2})],
        "num_key_value_heads": [Match({"num_key_value_heads": 4})],
        "rms_norm_eps": [Match({"rms_norm_eps": 0.1})],
        "attention_bias": [Match({"attention_bias": True})],
        "mlp_bias": [Match({"mlp_bias": True})],
        "head_dim": [Match({"head_dim": 16})],  # a config key the class reads with getattr (Llama: a field)
    }


# the mamba_* fields Bamba, GraniteMoeHybrid and Falcon-H1 read alike
MAMBA_CASES = {
    "mamba_d_state": [Match({"mamba_d_state": 4})],
    "mamba_d_conv": [Match({"mamba_d_conv": 3})],
    "mamba_conv_bias": [Match({"mamba_conv_bias": False})],
    "mamba_proj_bias": [Match({"mamba_proj_bias": True})],
    "time_step_limit": [Match({"time_step_limit": LIMIT})],
}

# field -> its cases; every field a spec reads has at least one (optional keys such as head_dim may have some too)
CASES: dict[str, dict[str, list]] = {
    "mamba2": {
        "num_heads": [Match({"num_heads": 4, "head_dim": 16}), Refuse({"num_heads": 6})],
        "head_dim": [Match({"head_dim": 4, "num_heads": 16, "n_groups": 4})],
        "vocab_size": [Match({"vocab_size": 50})],
        "hidden_size": [Match({"hidden_size": 48, "num_heads": 12})],
        "state_size": [Match({"state_size": 4})],
        "num_hidden_layers": [Match({"num_hidden_layers": 3})],
        "layer_norm_epsilon": [Match({"layer_norm_epsilon": 0.1})],
        "expand": [Match({"expand": 1, "num_heads": 4})],
        "conv_kernel": [Match({"conv_kernel": 2})],
        "n_groups": [Match({"n_groups": 1}), Match({"n_groups": 4})],
        "use_bias": [Match({"use_bias": True})],
        "use_conv_bias": [Match({"use_conv_bias": False})],
        "hidden_act": [Match({"hidden_act": "swish"}), Refuse({"hidden_act": "gelu"})],
        "residual_in_fp32": [Match({"residual_in_fp32": False})],
        "time_step_limit": [Match({"time_step_limit": LIMIT})],
        "tie_word_embeddings": [Match({"tie_word_embeddings": True})],
    },
    "nemotron_h": {
        "vocab_size": [Match({"vocab_size": 50})],
        "hidden_size": [Match({"hidden_size": 16, "mamba_num_heads": 4})],
        "layers_block_type": [Match({"layers_block_type": ["mlp", "full_attention", "linear_attention", "moe"]}),
                              Refuse({"layers_block_type": ["mamba", "sliding_attention"]})],
        "num_attention_heads": [Match({"num_attention_heads": 2, "num_key_value_heads": 2})],
        "num_key_value_heads": [Match({"num_key_value_heads": 4}), Match({"num_key_value_heads": 1})],
        "head_dim": [Match({"head_dim": 16})],
        "intermediate_size": [Match({"intermediate_size": 40})],
        "mlp_hidden_act": [Match({"mlp_hidden_act": "silu"}), Refuse({"mlp_hidden_act": "gelu"})],
        "mlp_bias": [Match({"mlp_bias": True}), Match({"mlp_bias": True, "moe_latent_size": 16})],
        "ssm_state_size": [Match({"ssm_state_size": 4})],
        "mamba_num_heads": [Match({"mamba_num_heads": 4, "mamba_head_dim": 16}), Refuse({"mamba_num_heads": 5})],
        "mamba_head_dim": [Match({"mamba_head_dim": 4, "mamba_num_heads": 16})],
        "mamba_hidden_act": [Refuse({"mamba_hidden_act": "relu"})],
        "n_groups": [Match({"n_groups": 1}), Match({"n_groups": 4})],
        "conv_kernel": [Match({"conv_kernel": 2})],
        "time_step_min": [Match({"time_step_min": 0.2})],
        "use_conv_bias": [Match({"use_conv_bias": False})],
        "n_routed_experts": [Match({"n_routed_experts": 8})],
        "moe_intermediate_size": [Match({"moe_intermediate_size": 16})],
        "moe_shared_expert_intermediate_size": [Match({"moe_shared_expert_intermediate_size": 12})],
        "moe_latent_size": [Match({"moe_latent_size": 16})],
        "num_experts_per_tok": [Match({"num_experts_per_tok": 3})],
        "routed_scaling_factor": [Match({"routed_scaling_factor": 0.5})],
        "n_group": [Match({"n_group": 2, "topk_group": 1})],
        "topk_group": [Match({"n_group": 2, "topk_group": 2})],
        "norm_topk_prob": [Match({"norm_topk_prob": False})],
        "use_bias": [Match({"use_bias": True})],
        "layer_norm_epsilon": [Match({"layer_norm_epsilon": 0.1})],
    },
    "granitemoehybrid": {
        "vocab_size": [Match({"vocab_size": 50})],
        "hidden_size": [Match({"hidden_size": 48})],
        "intermediate_size": [Match({"intermediate_size": 16})],
        "num_hidden_layers": [Match({"num_hidden_layers": 2, "layer_types": ["attention", "mamba"]}),
                              Refuse({"num_hidden_layers": 4}, "layer_types")],
        "num_attention_heads": [Match({"num_attention_heads": 2, "num_key_value_heads": 2})],
        "num_key_value_heads": [Match({"num_key_value_heads": 4}), Match({"num_key_value_heads": None})],
        "hidden_act": [Refuse({"hidden_act": "gelu"})],
        "rms_norm_eps": [Match({"rms_norm_eps": 0.1})],
        "tie_word_embeddings": [Match({"tie_word_embeddings": True})],
        "rope_parameters": [Match({"rope_parameters": ROPE}),
                            Match({"rope_parameters": {**ROPE, "partial_rotary_factor": 0.5}}),  # whole head
                            Refuse({"rope_parameters": YARN}, "rope_type='yarn'")],
        "attention_bias": [Match({"attention_bias": True})],
        "embedding_multiplier": [Match({"embedding_multiplier": 1.7})],
        "logits_scaling": [Match({"logits_scaling": 0.8})],
        "residual_multiplier": [Match({"residual_multiplier": 1.3})],
        "attention_multiplier": [Match({"attention_multiplier": 0.5})],
        "num_local_experts": [Match({"num_local_experts": 0}), Match({"num_local_experts": 6})],
        "num_experts_per_tok": [Match({"num_experts_per_tok": 3})],
        "shared_intermediate_size": [Match({"shared_intermediate_size": 12})],
        "position_embedding_type": [Match({"position_embedding_type": None}),
                                    Match({"position_embedding_type": "nope"})],  # anything but "rope": none
        "layer_types": [Match({"layer_types": ["attention", "mamba", "full_attention"]}),
                        Refuse({"layer_types": ["mamba", "moe", "mamba"]})],
        "mamba_n_heads": [Match({"mamba_n_heads": 8})],
        "mamba_n_groups": [Match({"mamba_n_groups": 1}), Match({"mamba_n_groups": 4})],
        "mamba_d_head": [Match({"mamba_d_head": 8, "mamba_n_heads": 8}), Refuse({"mamba_d_head": 7})],
        "mamba_expand": [Match({"mamba_expand": 1})],
        "head_dim": [Match({"head_dim": 16}), Match({"head_dim": 4, "position_embedding_type": None})],
        **MAMBA_CASES,
    },
    "bamba": {
        **_decoder_cases(layers=2),
        **MAMBA_CASES,
        "hidden_act": [Refuse({"hidden_act": "relu"})],
        "attn_layer_indices": [Match({"attn_layer_indices": [0, 2]}), Match({"attn_layer_indices": None}),
                               Match({"attn_layer_indices": [1, 7]})],
        "mamba_n_heads": [Match({"mamba_n_heads": 8})],
        "mamba_d_head": [Match({"mamba_d_head": 8, "mamba_n_heads": 8}), Refuse({"mamba_d_head": 7})],
        "mamba_n_groups": [Match({"mamba_n_groups": 4})],
        "mamba_expand": [Match({"mamba_expand": 1})],
        "rope_parameters": [Match({"rope_parameters": ROPE}),  # the class's forced partial_rotary_factor 0.5
                            Match({"rope_parameters": {**ROPE, "partial_rotary_factor": 1.0}}),
                            Match({"rope_parameters": {**ROPE, "partial_rotary_factor": 0.3}}),  # int(2.4)
                            Refuse({"rope_parameters": {**ROPE, "partial_rotary_factor": 0.2}},  # an odd 1
                                   "partial_rotary_factor"),
                            Refuse({"rope_parameters": YARN}, "rope_type='yarn'")],
    },
    "falcon_h1": {
        **_decoder_cases(layers=3),
        **MAMBA_CASES,
        "hidden_act": [Refuse({"hidden_act": "gelu"})],
        "mamba_d_ssm": [Match({"mamba_d_ssm": None, "mamba_n_heads": 8}), Match({"mamba_d_ssm": 24, "mamba_n_heads": 3,
                                                                                 "mamba_n_groups": 1})],
        "mamba_n_heads": [Match({"mamba_n_heads": 12})],
        "mamba_d_head": [Match({"mamba_d_head": 4, "mamba_n_heads": 12}), Refuse({"mamba_d_head": 7})],
        "mamba_n_groups": [Match({"mamba_n_groups": 1}), Match({"mamba_n_groups": 3})],
        "mamba_expand": [Match({"mamba_expand": 3, "mamba_d_ssm": None, "mamba_n_heads": 8})],
        "mamba_norm_before_gate": [Match({"mamba_norm_before_gate": False})],
        "mamba_rms_norm": [Match({"mamba_rms_norm": False})],
        "projectors_bias": [Match({"projectors_bias": True}),
                            Match({"projectors_bias": True, "mamba_proj_bias": True})],
        "rope_parameters": [Match({"rope_parameters": ROPE}),
                            Match({"rope_parameters": {**ROPE, "partial_rotary_factor": 0.5}}),  # whole head
                            Refuse({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'")],
        "lm_head_multiplier": [Match({"lm_head_multiplier": 0.3})],
        "embedding_multiplier": [Match({"embedding_multiplier": 1.5})],
        "mlp_multipliers": [Match({"mlp_multipliers": [0.5, 2.0]}), Match({"mlp_multipliers": None}),
                            Refuse({"mlp_multipliers": [1.0]}, r"mlp_multipliers=\[1.0\] must hold 2")],
        "key_multiplier": [Match({"key_multiplier": 0.7})],
        "attention_out_multiplier": [Match({"attention_out_multiplier": 0.9})],
        "attention_in_multiplier": [Match({"attention_in_multiplier": 1.1})],
        "ssm_multipliers": [Match({"ssm_multipliers": [1.2, 0.8, 1.5, 0.7, 1.1]}), Match({"ssm_multipliers": None}),
                            Refuse({"ssm_multipliers": [1.0, 2.0]}, r"ssm_multipliers=\[1.0, 2.0\] must hold 5")],
        "ssm_in_multiplier": [Match({"ssm_in_multiplier": 0.8})],
        "ssm_out_multiplier": [Match({"ssm_out_multiplier": 1.2})],
    },
    "zamba2": {
        "vocab_size": [Match({"vocab_size": 50})],
        "hidden_size": [Match({"hidden_size": 48})],
        "num_hidden_layers": [Refuse({"num_hidden_layers": 4})],
        "layers_block_type": [Match({"layers_block_type": ["hybrid", "linear_attention", "hybrid"]}),
                              Refuse({"layers_block_type": ["mamba", "attention"]})],
        "mamba_d_state": [Match({"mamba_d_state": 4})],
        "mamba_d_conv": [Match({"mamba_d_conv": 2})],
        "mamba_expand": [Match({"mamba_expand": 1})],
        "mamba_ngroups": [Match({"mamba_ngroups": 1}), Match({"mamba_ngroups": 4})],
        "time_step_min": [Match({"time_step_min": 0.2})],
        "n_mamba_heads": [Match({"n_mamba_heads": 8}), Refuse({"n_mamba_heads": 7})],
        "add_bias_linear": [Match({"add_bias_linear": True})],
        "intermediate_size": [Match({"intermediate_size": None}), Match({"intermediate_size": 24})],
        "hidden_act": [Match({"hidden_act": "silu"}), Refuse({"hidden_act": "gelu_new"})],
        "num_attention_heads": [Match({"num_attention_heads": 8}), Refuse({"num_attention_heads": 3})],
        "num_key_value_heads": [Match({"num_key_value_heads": 2, "use_shared_attention_adapter": False}),
                                Refuse({"num_key_value_heads": 2})],  # the adapters need full K/V heads
        "num_mem_blocks": [Match({"num_mem_blocks": 1}), Match({"num_mem_blocks": 3})],
        "use_shared_attention_adapter": [Match({"use_shared_attention_adapter": False})],
        "use_mem_rope": [Match({"use_mem_rope": False})],
        "rope_parameters": [Match({"rope_parameters": ROPE}),
                            Match({"rope_parameters": {**ROPE, "partial_rotary_factor": 0.5}}),  # whole head
                            Refuse({"rope_parameters": YARN}, "rope_type='yarn'")],
        "rms_norm_eps": [Match({"rms_norm_eps": 0.1})],
        # untied, every hybrid layer has its own block, with adapter slots for its block's other uses that no
        # layer runs (transformers neither): loading names them
        "tie_word_embeddings": [Match({"tie_word_embeddings": False}, warns="another use's LoRA adapter")],
        # derived sizes transformers saves and then reads back over the derived value
        "attention_head_dim": [Match({"attention_head_dim": 8, "use_shared_attention_adapter": False}),
                               Refuse({"attention_head_dim": 8}, "use_shared_attention_adapter")],
        "head_dim": [Match({"head_dim": 12, "use_shared_attention_adapter": False})],
        "mamba_headdim": [Refuse({"mamba_headdim": 8})],
        "attention_hidden_size": [Refuse({"attention_hidden_size": 32})],
        "hybrid_layer_ids": [Refuse({"hybrid_layer_ids": [1, 3]})],
    },
    "llama": {
        **_decoder_cases(layers=3),
        "num_key_value_heads": [Match({"num_key_value_heads": 4}), Match({"num_key_value_heads": None})],
        "hidden_act": [Refuse({"hidden_act": "gelu"})],
        "rope_parameters": [Match({"rope_parameters": ROPE}),
                            Match({"rope_parameters": {**ROPE, "partial_rotary_factor": 0.5}}),  # whole head
                            Refuse({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64}},
                                   "rope_type='llama3'")],
    },
}

# a value for every field a spec ignores, all set at once: the logits must still equal transformers'
IGNORED_VALUES: dict[str, dict] = {
    "mamba2": {"pad_token_id": 5, "bos_token_id": 3, "eos_token_id": 4, "use_cache": False, "initializer_range": 0.01,
               "time_step_min": 0.01, "time_step_max": 0.2, "time_step_floor": 1e-3, "rescale_prenorm_residual": True,
               "time_step_rank": 7, "chunk_size": 4},
    "nemotron_h": {"tie_word_embeddings": True, "use_cache": False, "num_logits_to_keep": 3, "pad_token_id": 5,
                   "bos_token_id": 3, "eos_token_id": 4, "max_position_embeddings": 16, "attention_bias": True,
                   "attention_dropout": 0.3, "sliding_window": 2, "use_mamba_kernels": False, "expand": 4,
                   "time_step_max": 0.3, "time_step_limit": [0.0, 1.0], "time_step_floor": 1e-3, "chunk_size": 4,
                   "mamba_proj_bias": True, "mamba_ssm_cache_dtype": "bfloat16", "output_router_logits": True,
                   "n_shared_experts": 2, "moe_shared_expert_overlap": False, "num_nextn_predict_layers": 1,
                   "mtp_layers_block_type": ["full_attention", "mlp"], "initializer_range": 0.01,
                   "residual_in_fp32": True, "hidden_dropout": 0.2, "rescale_prenorm_residual": False},
    "granitemoehybrid": {"max_position_embeddings": 16, "initializer_range": 0.01, "use_cache": False,
                         "pad_token_id": 5, "bos_token_id": 3, "eos_token_id": 4, "attention_dropout": 0.3,
                         "output_router_logits": True, "router_aux_loss_coef": 0.5, "mamba_chunk_size": 4},
    "bamba": {"initializer_range": 0.01, "use_cache": False, "num_logits_to_keep": 3, "pad_token_id": 5,
              "bos_token_id": 3, "eos_token_id": 4, "max_position_embeddings": 16, "attention_dropout": 0.3,
              "mamba_chunk_size": 4, "z_loss_coefficient": 0.5},
    "falcon_h1": {"initializer_range": 0.01, "use_cache": False, "num_logits_to_keep": 3, "pad_token_id": 5,
                  "bos_token_id": 3, "eos_token_id": 4, "max_position_embeddings": 16, "attention_dropout": 0.3,
                  "mamba_chunk_size": 4},
    "zamba2": {"max_position_embeddings": 16, "time_step_max": 0.3, "time_step_floor": 1e-3,
               "use_mamba_kernels": False, "use_conv_bias": False, "chunk_size": 4, "use_mem_eff_path": True,
               "attention_dropout": 0.3, "adapter_rank": 8, "initializer_range": 0.01, "use_cache": False,
               "num_logits_to_keep": 3, "pad_token_id": 5, "bos_token_id": 3, "eos_token_id": 4,
               "use_long_context": True},
    "llama": {"max_position_embeddings": 16, "initializer_range": 0.01, "use_cache": False, "pad_token_id": 5,
              "bos_token_id": 3, "eos_token_id": 4, "pretraining_tp": 2, "attention_dropout": 0.3},
}


def _class_fields(family: str) -> dict:
    """``field -> default`` of the family's transformers config class, without PreTrainedConfig's own fields."""
    cls = getattr(transformers, SPECS[family].class_name)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in hf_fields.BASE_FIELDS:
            continue
        out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def _plain(value):
    """Defaults compared as JSON sees them (tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value


def _cases():
    for family, table in CASES.items():
        for field, cases in table.items():
            for k, case in enumerate(cases):
                yield pytest.param(family, field, case, id=f"{family}-{field}-{k}")


def _load_tiny(family: str, tmp_path, over: dict, warns: str | None = None):
    """(transformers model, stree model) of ``family``'s tiny model with ``over``; loading warns only when
    ``warns`` matches (and then must)."""
    hf = build_tiny(family, random_biases=True, **over)
    if family == "llama":
        folder = write_llama_as_mambainllama(hf, tmp_path / family)
    else:
        folder = save_tiny(hf, tmp_path / family)
    if warns is not None:
        with pytest.warns(CheckpointWarning, match=warns):
            return hf, load_model(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        return hf, load_model(folder)


def _assert_logits_equal(hf, model):
    ids = torch.randint(0, hf.config.vocab_size, (12,)).tolist()
    torch.testing.assert_close(model.score_sequence(ids), hf_logits(hf, ids), atol=1e-5, rtol=1e-5)


def _refused_config(family: str, over: dict) -> dict:
    data = getattr(transformers, SPECS[family].class_name)(**tiny_kwargs(family)).to_dict()
    data.update(over)
    data = json.loads(json.dumps(data, default=float))
    if family == "llama":
        data["__mamba_config__"] = {"d_model": data["hidden_size"], "ssm_cfg": {"d_state": 8, "ngroups": 4},
                                    "d_inner": 32, "d_xb": 16, "attn_layers": []}
    return data


def test_base_fields_are_pretrained_configs():
    assert {f.name for f in dataclasses.fields(transformers.PreTrainedConfig)} == hf_fields.BASE_FIELDS


def test_transformers_is_the_checked_release():
    assert transformers.__version__.startswith(hf_fields.TRANSFORMERS_CHECKED + ".")


@pytest.mark.parametrize("family", sorted(SPECS))
def test_spec_holds_every_field_with_transformers_default(family):
    spec, fields = SPECS[family], _class_fields(family)
    assert sorted(set(fields) - set(spec.defaults)) == [], "fields of a newer transformers: classify them"
    assert sorted(set(spec.defaults) - set(fields)) == [], "fields transformers no longer has"
    for name, default in fields.items():
        assert _plain(spec.defaults[name]) == _plain(default), name
    assert set(spec.ignored) <= set(fields)


@pytest.mark.parametrize("family", sorted(SPECS))
def test_every_read_field_has_cases_and_every_ignored_field_a_value(family):
    spec = SPECS[family]
    read = set(spec.defaults) - set(spec.ignored)
    assert sorted(read - set(CASES[family])) == []
    assert set(CASES[family]) <= read | set(spec.optional)
    assert set(IGNORED_VALUES[family]) == set(spec.ignored)


@pytest.mark.parametrize("family,field,case", list(_cases()))
def test_field_is_followed_or_refused_by_name(family, field, case, tmp_path):
    assert field in case.over
    if isinstance(case, Match):
        _assert_logits_equal(*_load_tiny(family, tmp_path, case.over, case.warns))
    else:
        with pytest.raises(ValueError, match=case.message or re.escape(field)):
            resolve(_refused_config(family, case.over))


@pytest.mark.parametrize("family", sorted(SPECS))
def test_ignored_fields_changed_at_once_keep_transformers_logits(family, tmp_path):
    _assert_logits_equal(*_load_tiny(family, tmp_path, IGNORED_VALUES[family]))


def test_ignored_values_differ_from_the_tiny_models():
    for family, over in IGNORED_VALUES.items():
        for name, value in over.items():
            assert _plain(TINY[family][1].get(name, SPECS[family].defaults[name])) != _plain(value), (family, name)


def test_inf_time_step_limit_reads_as_json_writes_it():
    data = transformers.Mamba2Config(**tiny_kwargs("mamba2")).to_dict()
    data["time_step_limit"] = [0.0, {"__float__": "Infinity"}]
    config, _ = resolve(data)
    assert config.ssm["dt_limit"] == [0.0, math.inf]
