"""The cost model of docs/cost-model.md: formulas (model.py), their inputs (presets.py, calibrate.py), the
validation against cpu-scale run records (validate.py), the GPU projection (projection.py), the host's ceiling beside a
measured speedup (host_ceiling.py) and the what-if command (whatif.py); its tables and figures are in
zenflow/reports/costmodel.py. `reproduce/project.py` drives them."""
