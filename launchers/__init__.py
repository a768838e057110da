"""Entry points: train.py, evaluate.py, convert.py, generate.py (each docstring shows its command lines)."""
