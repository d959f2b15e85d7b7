"""The balance dashboards: TensorBoard runs (`summaries.BalanceWriter`) and the PNG (`plot`).

Imports the core only (tests/test_layers.py).
"""
