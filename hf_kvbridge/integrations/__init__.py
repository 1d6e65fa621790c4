"""Integrations with the ecosystem: lm-eval (`lm_eval`), the Hugging Face Hub (`hub`) and vLLM (`vllm`)."""
