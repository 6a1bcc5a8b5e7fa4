"""Built-in recipes of `ringcheck step` (templates users copy): `plain` (ringcheck's own small
Llama, the step written out in plain torch) and `hf_llama` (transformers' LlamaForCausalLM)."""
