"""The engine under train.py: what makes the recipe run at scale and survive, which a reader of the paper may skip.
Each module imports only from those before it in README's file table (checked by tests/test_docs.py)."""
