"""Integrations with serving engines (vLLM) and with an installed LMCache."""
