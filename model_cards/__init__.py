"""Model card templates of hf_kvbridge (Jinja), shipped inside the wheel as `hf_kvbridge.model_cards`."""
