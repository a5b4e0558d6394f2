"""Builds the optional C extensions that decode and encode Avro blocks (schemas/_blockdecode.pyx,
schemas/_blockencode.pyx) and run the streams' innermost loops (streams/_loops.pyx).

Everything else is declared in pyproject.toml. The extensions are optional: where they cannot be
compiled, ``schemas.codec`` decodes and encodes with fastavro alone (about 7x slower per record
decoded, about 10x per record encoded), and the streams' figures and histograms run their methods'
own Python.
"""

from setuptools import Extension, setup

try:
    from Cython.Build import cythonize
except ImportError:  # no Cython in the build environment: pure Python install
    extensions = []
else:
    extensions = cythonize([Extension("rlpulse.schemas._blockdecode", ["schemas/_blockdecode.pyx"], optional=True),
                            Extension("rlpulse.schemas._blockencode", ["schemas/_blockencode.pyx"], optional=True),
                            Extension("rlpulse.streams._loops", ["streams/_loops.pyx"], optional=True)],
                           language_level=3, quiet=True)

setup(ext_modules=extensions)
