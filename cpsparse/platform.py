"""The platform a layer runs on, as the construction-time gate sees it.

Anything with an ``is_cuda()`` method is a platform; the default one says True
only when CuPy sees a CUDA device. Tests inject :class:`StaticPlatform` to
exercise the CUDA branch of the gate on a CPU machine.
"""

from cpsparse import _backend

__all__ = ["current_platform", "StaticPlatform"]


class _DetectedPlatform:
    def is_cuda(self):
        return _backend.gpu_available()

    def __repr__(self):
        return f"DetectedPlatform(is_cuda={self.is_cuda()})"


class StaticPlatform:
    """A platform with a fixed answer.

    Parameters
    ----------
    cuda : bool
        What :meth:`is_cuda` returns.

    Examples
    --------
    >>> from cpsparse.platform import StaticPlatform
    >>> StaticPlatform(cuda=True).is_cuda()
    True
    """

    def __init__(self, cuda):
        self._cuda = bool(cuda)

    def is_cuda(self):
        return self._cuda

    def __repr__(self):
        return f"StaticPlatform(cuda={self._cuda})"


def current_platform():
    """The detected platform (CUDA when CuPy sees a device).

    Returns
    -------
    object with ``is_cuda()``
        ``is_cuda()`` is True when CuPy sees a CUDA device.
    """
    return _DetectedPlatform()
