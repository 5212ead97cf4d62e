"""Where the model runs: in this process (`ModelRunner`), or split over processes (`MultiprocExecutor`)."""
