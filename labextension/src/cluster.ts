/**
 * The sidebar's Cluster section: every host of the cluster from the server's Prometheus
 * (`GET cluster`, see docs/cluster.md), best host first, with load, holders and "as of" times;
 * hosts whose data is stale or whose exporter is down are marked so. Hidden when the server has
 * no `c.AutoGPU.prometheus_url`.
 *
 * The panel calls {@link ClusterSection.refresh} at each of its refreshes; the section asks the
 * server at most every {@link MIN_INTERVAL_MS} (each answer costs the server a few Prometheus
 * queries). Everything from the server is written with `textContent`, never as HTML.
 */
import { ServerConnection } from '@jupyterlab/services';
import { TranslationBundle, nullTranslator } from '@jupyterlab/translation';

import {
  clusterView,
  ICluster,
  IClusterHistory,
  IClusterView,
  parseCluster,
  parseClusterHistory
} from './clustermodel';
import { sparklinePath } from './model';
import { MISSING_SERVER_EXTENSION, requestAPI } from './request';

/** Least time between two `GET cluster` requests of one sidebar. */
export const MIN_INTERVAL_MS = 5000;
/** Least time between two `GET cluster/history` requests (range queries are dearer). */
export const HISTORY_INTERVAL_MS = 60000;
/** The history each host shows: the last day. */
export const HISTORY_SECONDS = 86400;

const SVG_NS = 'http://www.w3.org/2000/svg';
const SPARK_W = 120;
const SPARK_H = 18;

function el(tag: string, className: string, text?: string): HTMLElement {
  const node = document.createElement(tag);
  node.className = className;
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

/** The Cluster section; append {@link node} to the panel. */
export class ClusterSection {
  readonly node: HTMLElement;

  constructor(
    serverSettings: ServerConnection.ISettings,
    trans: TranslationBundle = nullTranslator.load('autogpu_jupyter')
  ) {
    this._serverSettings = serverSettings;
    this._trans = trans;
    this.node = el('section', 'jp-AutoGPU-cluster');
    this.node.hidden = true;
  }

  /** Ask the server (unless asked less than MIN_INTERVAL_MS ago) and render; never throws. */
  async refresh(minFree: string): Promise<void> {
    const now = Date.now();
    if (this._busy || now - this._lastMs < MIN_INTERVAL_MS) {
      return;
    }
    this._busy = true;
    this._lastMs = now;
    try {
      const query = minFree ? `?min_free=${encodeURIComponent(minFree)}` : '';
      const raw = await requestAPI<unknown>(
        `cluster${query}`,
        this._serverSettings
      );
      const cluster = parseCluster(raw);
      await this._refreshHistory(cluster, now);
      this._render(
        clusterView(cluster, Date.now() / 1000, this._history, this._trans),
        null
      );
    } catch (reason) {
      const text =
        reason instanceof Error ? reason.message : String(reason ?? '');
      if (text === MISSING_SERVER_EXTENSION) {
        // The panel above says it once; the cluster section has nothing to add.
        this.node.replaceChildren();
        this.node.hidden = true;
        return;
      }
      this._render(null, this._trans.__('cluster view unavailable: %1', text));
    } finally {
      this._busy = false;
    }
  }

  /** The hosts' history, asked at most every HISTORY_INTERVAL_MS; kept when it fails. */
  private async _refreshHistory(cluster: ICluster, now: number): Promise<void> {
    if (!cluster.configured || now - this._historyMs < HISTORY_INTERVAL_MS) {
      return;
    }
    this._historyMs = now;
    try {
      this._history = parseClusterHistory(
        await requestAPI<unknown>(
          `cluster/history?seconds=${HISTORY_SECONDS}`,
          this._serverSettings
        )
      );
    } catch {
      // the snapshot still shows; the history comes back at the next try
    }
  }

  private _render(view: IClusterView | null, failure: string | null): void {
    this.node.replaceChildren();
    if (view === null) {
      // Only say so where the section was showing (a server without the endpoint stays quiet).
      this.node.hidden = this._shown === false;
      this.node.appendChild(el('div', 'jp-AutoGPU-error', failure ?? ''));
      return;
    }
    this._shown = view.visible;
    this.node.hidden = !view.visible;
    if (!view.visible) {
      return;
    }
    const header = el('div', 'jp-AutoGPU-clusterHeader');
    header.append(
      el('h3', 'jp-AutoGPU-clusterTitle', this._trans.__('Cluster')),
      el('span', 'jp-AutoGPU-clusterSource', view.source)
    );
    this.node.appendChild(header);
    for (const message of view.errors) {
      this.node.appendChild(el('div', 'jp-AutoGPU-error', message));
    }
    if (view.advice) {
      this.node.appendChild(el('div', 'jp-AutoGPU-clusterAdvice', view.advice));
    }
    for (const host of view.hosts) {
      const box = el('div', `jp-AutoGPU-host jp-AutoGPU-host-${host.state}`);
      box.dataset.hostname = host.hostname;
      const title = el('div', 'jp-AutoGPU-hostTitle');
      title.appendChild(el('span', 'jp-AutoGPU-hostName', host.hostname));
      if (host.badge) {
        title.appendChild(
          el(
            'span',
            `jp-AutoGPU-badge jp-AutoGPU-hostState jp-AutoGPU-${host.badge}`,
            host.badge === 'down'
              ? this._trans.__('down')
              : host.badge === 'stale'
                ? this._trans.__('stale')
                : host.badge
          )
        );
      }
      if (host.best) {
        title.appendChild(
          el('span', 'jp-AutoGPU-badge jp-AutoGPU-best', this._trans.__('best'))
        );
      }
      title.appendChild(el('span', 'jp-AutoGPU-asOf', host.asOf));
      box.appendChild(title);
      if (host.note) {
        box.appendChild(el('div', 'jp-AutoGPU-hostNote', host.note));
      }
      if (host.history) {
        const line = el('div', 'jp-AutoGPU-hostHistory');
        const svg = document.createElementNS(SVG_NS, 'svg');
        svg.setAttribute('class', 'jp-AutoGPU-spark jp-AutoGPU-hostSpark');
        svg.setAttribute('viewBox', `0 0 ${SPARK_W} ${SPARK_H}`);
        svg.setAttribute('preserveAspectRatio', 'none');
        const path = document.createElementNS(SVG_NS, 'path');
        path.setAttribute(
          'd',
          sparklinePath(host.history.values, SPARK_W, SPARK_H, 100)
        );
        svg.appendChild(path);
        line.append(
          svg,
          el('span', 'jp-AutoGPU-hostHistoryText', host.history.label)
        );
        box.appendChild(line);
      }
      const list = el('ul', 'jp-AutoGPU-hostGpus');
      for (const gpu of host.gpus) {
        const item = el(
          'li',
          gpu.lost ? 'jp-AutoGPU-hostGpu jp-AutoGPU-lost' : 'jp-AutoGPU-hostGpu'
        );
        const name = el('div', 'jp-AutoGPU-hostGpuTitle');
        name.append(
          el('span', 'jp-AutoGPU-label', gpu.label),
          el('span', 'jp-AutoGPU-name', gpu.name)
        );
        const load = el('div', 'jp-AutoGPU-hostGpuLoad');
        load.append(
          el('span', 'jp-AutoGPU-hostUtil', gpu.util),
          el('span', 'jp-AutoGPU-hostMem', gpu.memory)
        );
        if (gpu.source) {
          load.appendChild(
            el('span', 'jp-AutoGPU-badge jp-AutoGPU-source', gpu.source)
          );
        }
        item.append(name, load);
        if (gpu.holders) {
          item.appendChild(el('div', 'jp-AutoGPU-hostHolders', gpu.holders));
        }
        list.appendChild(item);
      }
      box.appendChild(list);
      this.node.appendChild(box);
    }
  }

  private _serverSettings: ServerConnection.ISettings;
  private _trans: TranslationBundle;
  private _lastMs = 0;
  private _historyMs = -HISTORY_INTERVAL_MS;
  private _history: IClusterHistory | null = null;
  private _busy = false;
  private _shown: boolean | null = null;
}
