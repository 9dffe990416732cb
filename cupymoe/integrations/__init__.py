"""Bridges from other libraries' loaded models to cupymoe layers (each needs that library: imported lazily)."""
