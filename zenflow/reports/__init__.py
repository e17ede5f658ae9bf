"""Tables, figures and the claims table, made from run records only: the top layer, above the harness (runs,
records) and the cost model, and imported by neither (tests/project/test_import_layers.py)."""
