# The pipeline's processes (`rlpulse streams`, `rlpulse sink`) for docker-compose.yml.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 RLPULSE_HOME=/var/lib/rlpulse
WORKDIR /src
# Only what the package is built from: the checkout's .venv and .rlpulse stay out of the image.
COPY pyproject.toml README.m[d] ./
COPY rlpulse ./rlpulse
COPY base ./base
COPY schemas ./schemas
COPY producers ./producers
COPY streams ./streams
COPY sinks ./sinks
RUN pip install '.[pipeline]' \
    && useradd --system --create-home --home-dir /var/lib/rlpulse rlpulse
USER rlpulse
WORKDIR /var/lib/rlpulse
ENTRYPOINT ["rlpulse"]
