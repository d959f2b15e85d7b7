"""The pure core: split arithmetic, device peaks, controllers, simulator, protocols.

Pure Python and numpy: nothing here imports TensorFlow, Keras or TensorBoard, nor any other
layer of the package (tests/test_layers.py), so it is tested fast and can serve any framework.
"""
