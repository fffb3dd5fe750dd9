"""Elastic mode of ``horovodrun``: discovery, blacklist, the driver and its worker processes.

The worker side (``State``, the ``run`` loop, joining rounds) is ``horovod.common.elastic``; the
protocol between the two is ``horovod.common.rendezvous``.
"""
