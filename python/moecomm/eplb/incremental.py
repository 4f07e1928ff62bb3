def rebalance_incremental(*a, **k):
    raise NotImplementedError
