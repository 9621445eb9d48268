"""The tests beyond test_model.py, one file per part (README: Tests). A package, so that a test imports another's
fixtures by its name (`from tests.test_train import SMALL`) and `python -m tests.test_fork` runs from the root."""
