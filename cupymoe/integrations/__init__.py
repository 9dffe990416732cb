"""Bridges from other libraries' loaded models to cupymoe layers (each needs that library: imported lazily)."""


def __getattr__(name):
    if name == "transformers":  # cupymoe.integrations.transformers.replace_moe_blocks(...) after `import cupymoe`
        import importlib

        return importlib.import_module(".transformers", __name__)
    raise AttributeError(f"module 'cupymoe.integrations' has no attribute {name!r}")
