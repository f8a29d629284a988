# Wires the difftest plugin into every pytest run from this repository
# (`pytest cases/ --engines=...` and the harness's own tests).
pytest_plugins = ["difftest.plugin", "pytester"]
