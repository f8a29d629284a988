"""Floor 8, the checks a case runs per engine (checks), each returning a Verdict (verdict): the
config lint (lint), layer-id readings and fixes (layer_reading), golden inputs (golden) and the
tensors each check judges (scopes)."""
