"""inturn's benchmark: ``python -m bench``. See bench/run.py."""
