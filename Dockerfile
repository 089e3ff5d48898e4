# The rolloutlog service. Build: docker build -t rolloutlog .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY rolloutlog ./rolloutlog
RUN pip install . && useradd --system --uid 10001 rolloutlog && mkdir /data && chown rolloutlog /data
USER rolloutlog
EXPOSE 8750
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8750/readyz', timeout=2)"]
# SIGTERM: stop accepting, finish in-flight appends, close the log and catalog, exit 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["rolloutlog", "serve", "--data-dir", "/data", "--host", "0.0.0.0", "--port", "8750"]
