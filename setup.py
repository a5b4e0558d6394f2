"""Builds the optional C extension that decodes Avro blocks (schemas/_blockdecode.pyx).

Everything else is declared in pyproject.toml. The extension is optional: where it cannot be
compiled, ``schemas.codec`` decodes with fastavro alone (about 7x slower per record).
"""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # no Cython in the build environment: pure Python install
    extensions = []
else:
    extensions = cythonize([Extension("rlpulse.schemas._blockdecode", ["schemas/_blockdecode.pyx"], optional=True)],
                           language_level=3, quiet=True)

setup(ext_modules=extensions)
