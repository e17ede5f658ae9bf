"""The cost model of docs/cost-model.md: formulas (model.py), their inputs (presets.py, calibrate.py), the
validation against cpu-scale run records (validate.py), the GPU projection (projection.py), tables and figures
(tables.py) and the what-if command (whatif.py). `reproduce/project.py` drives them."""
