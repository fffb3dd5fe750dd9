"""Keras implementation shared by ``horovod.tensorflow.keras`` (tf.keras) and ``horovod.keras``.

Modules, lowest first (each imports only those before it, and ``horovod.tensorflow`` only where the
Keras backend is TensorFlow): ``backends`` (gradient reductions for Keras 3's torch and JAX backends),
``optimizer`` (the distributed optimizer wrapper), ``state`` (elastic copies of variables), all three
without TensorFlow; ``helpers`` (the functions both bindings share, ``load_model``, learning-rate access,
the one choice of TensorFlow or not: ``uses_tensorflow``), ``callbacks``, ``elastic``. The TensorFlow
reduction of the wrapper is ``horovod.tensorflow._keras_optimizer``. This package module imports
nothing, so that ``horovod.tensorflow`` can use the lower modules without a cycle.
"""
