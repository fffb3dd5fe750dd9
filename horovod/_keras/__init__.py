"""Keras implementation shared by ``horovod.tensorflow.keras`` (tf.keras) and ``horovod.keras``.

Modules, lowest first (each imports only those before it, and ``horovod.tensorflow``):
``backends`` (gradient reductions for Keras 3's torch and JAX backends; no TensorFlow),
``helpers`` (the functions both bindings share, ``load_model``, learning-rate access), ``callbacks``, ``elastic``. The
distributed optimizer itself is ``horovod.tensorflow._keras_optimizer``. This package module imports
nothing, so that ``horovod.tensorflow`` can use ``backends`` without a cycle.
"""
