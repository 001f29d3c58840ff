"""The tmrun node agent: membership and leases in etcd, the leader, generations, worker supervision.

Workers never import this package; the worker-side runtime lives in :mod:`tmrun`.
"""
