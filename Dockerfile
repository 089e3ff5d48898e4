# The rolloutlog service. Build: docker build -t rolloutlog .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY rolloutlog ./rolloutlog
RUN pip install '.[server]' && useradd --system --uid 10001 rolloutlog && mkdir /data && chown rolloutlog /data
USER rolloutlog
# Configured by ROLLOUTLOG_* variables (docs/api.md, "Configuration"): these defaults for a
# container, the rest (log and catalog URLs, tokens, *_FILE secrets) from the deployment. Flags
# given after the image name override them.
ENV ROLLOUTLOG_DATA_DIR=/data ROLLOUTLOG_HOST=0.0.0.0 ROLLOUTLOG_PORT=8750
EXPOSE 8750
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('ROLLOUTLOG_PORT', '8750'), timeout=2)"]
# SIGTERM: stop accepting, finish in-flight appends, close the log and catalog, exit 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["rolloutlog", "serve"]
