"""The baseline "adamw": torch.optim.AdamW itself (the registry names torch's class), so it makes no
claims of its own beyond the contract (test_contract.py), which runs it by the `CONTRACT` below."""

from __future__ import annotations

import harness

#: How the contract runs "adamw": with its registry defaults it is torch.optim.AdamW, exactly.
CONTRACT = harness.Case(reduces=(harness.Reduction("registry_defaults", harness.ADAMW_SETTINGS),))
