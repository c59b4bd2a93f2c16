"""Performance fixes of issue 9 that change behaviour: polling, partition cache."""

import numpy as np

import registry
from fedderm import data


def test_fast_poll_grid_polls_the_in_memory_grid_more_often():
    from strategies.common import IN_MEMORY_POLL_INTERVAL, POLL_INTERVAL, FastPollGrid

    class InMemoryGrid:  # stands for Flower's simulation grid (matched by class name)
        pass

    class HttpGrid:
        pass

    assert FastPollGrid(InMemoryGrid()).poll_interval == IN_MEMORY_POLL_INTERVAL < POLL_INTERVAL
    assert FastPollGrid(HttpGrid()).poll_interval == POLL_INTERVAL
    assert FastPollGrid(HttpGrid(), poll_interval=0.5).poll_interval == 0.5


def test_every_client_of_a_process_reuses_one_partition_of_the_pool(tmp_path, monkeypatch):
    cfg = registry.load_config({"synthetic-per-class": 4, "image-size": 16, "partition": "source",
                                "cache-dir": str(tmp_path)})  # one site per client
    calls = []
    real = data.partition_indices
    monkeypatch.setattr(data, "partition_indices", lambda *a, **k: calls.append(a) or real(*a, **k))
    clients = [data.load_client_data(cfg, p, 5) for p in range(5)]
    assert len(calls) == 1  # not once per client
    pool = clients[0].pool
    fresh = real("source", pool.labels, 5, seed=cfg.seed, sites=pool.sites, site_names=pool.site_names)
    for p, client in enumerate(clients):
        s = client.split
        assert np.array_equal(np.sort(np.concatenate([s.train, s.val, s.test])), fresh[p])
    other_seed = registry.load_config({**cfg.to_flat(), "seed": 1})
    data.load_client_data(other_seed, 0, 5)
    assert len(calls) == 2  # another seed is another partition
