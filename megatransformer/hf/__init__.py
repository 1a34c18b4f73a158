"""Mapping between our decoders and Hugging Face ``transformers`` classes (config and weight names).

Five families map exactly, so ``transformers`` computes the same function with no custom code:

- ``LlamaForCausalLM``: pre-LN, rmsnorm, rope (scaled or not: ``rope_parameters``), swiglu, no biases (MHA, GQA
  or MQA);
- ``MistralForCausalLM``: the same with a sliding window (``sliding_window``, Llama's weight names);
- ``Qwen3ForCausalLM``: Llama with QK-norm (``q_norm``, ``k_norm``), with or without a sliding window in every layer;
- ``GPT2LMHeadModel``: pre-LN, layernorm, learned positions, (exact) gelu, biases, MHA, tied embeddings;
- ``DeepseekV3ForCausalLM``: Llama's layout with multi-head latent attention, every MLP dense
  (``first_k_dense_replace`` = layers); mixture-of-experts layers are refused on import.

Each family is a table (:class:`Family`) of what must hold on each side; a conversion either maps a field
exactly or refuses it with one line naming the field and its value, in both directions (docs/conversions.md).
Close relatives our blocks cannot express are refused with the reason (``UNEXPRESSIBLE``). One module per family;
``family`` holds the table machinery they share, ``convert`` the model directories.
"""

from __future__ import annotations

from megatransformer.hf.convert import FAMILIES, UNEXPRESSIBLE, hf_family, hf_incompatibility, load_hf_dir, save_hf_dir
from megatransformer.hf.deepseek import DEEPSEEK_V3
from megatransformer.hf.family import IGNORED_KEYS, Family
from megatransformer.hf.gpt2 import GPT2
from megatransformer.hf.llama import LLAMA
from megatransformer.hf.mistral import MISTRAL
from megatransformer.hf.qwen3 import QWEN3

__all__ = [
    "DEEPSEEK_V3",
    "FAMILIES",
    "GPT2",
    "IGNORED_KEYS",
    "LLAMA",
    "MISTRAL",
    "QWEN3",
    "UNEXPRESSIBLE",
    "Family",
    "hf_family",
    "hf_incompatibility",
    "load_hf_dir",
    "save_hf_dir",
]
