"""The instance program: a scheduler per prefill/decode instance driving its rank workers."""
