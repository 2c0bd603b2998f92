"""How long a shared-memory waiter spins before it sleeps in the kernel
(``ShmConfig.spins``): 400 checks, or none on a node that runs more ranks than it has
CPUs (Open MPI turns on yield-when-idle by itself there); DISTLAUNCH_SHM_SPIN wins."""

import os

from distlaunch.collectives.transport.shm import ShmConfig

CPUS = os.cpu_count() or 1


def test_a_node_with_a_cpu_per_rank_spins():
    assert ShmConfig.from_env({}).spins(1) == 400
    assert ShmConfig.from_env({}).spins(CPUS) == 400


def test_an_oversubscribed_node_sleeps_at_once():
    assert ShmConfig.from_env({}).spins(CPUS + 1) == 0


def test_the_setting_wins_either_way():
    assert ShmConfig.from_env({"DISTLAUNCH_SHM_SPIN": "7"}).spins(CPUS + 1) == 7
    assert ShmConfig.from_env({"DISTLAUNCH_SHM_SPIN": "0"}).spins(1) == 0
