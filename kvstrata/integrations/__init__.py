"""Adapters that let other serving engines use kvstrata's tiers (vLLM KV connector, SGLang
HiCache storage), one module or subpackage per engine. Nothing below imports this."""
