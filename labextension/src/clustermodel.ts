/**
 * The sidebar's Cluster section, as data: validation of `GET cluster` and the pure function that
 * turns it into what the section shows (tested with jest; `cluster.ts` only writes it into the DOM
 * with `textContent`). Hosts come from the server's Prometheus (see docs/cluster.md); ranking is
 * the server's (the local pick's policy), never redone here.
 */
import { ITrans, formatBytes, formatPct, noTranslation } from './model';
import type * as wire from './schema';

/*
 * The answers' shapes come from the wire's, generated from the server's schema
 * (autogpu_jupyter/server/schema.py -> `./schema`): the section keeps the fields it reads
 * (`Pick`: a field the server stops sending, or renames, no longer compiles) and reshapes two
 * (the ranking names devices by label; the history keys hosts by name).
 */

/** One GPU of a host, as `GET cluster` sends it (the fields the section reads). */
export type IClusterDevice = Pick<
  wire.IClusterDeviceJSON,
  | 'uuid'
  | 'label'
  | 'name'
  | 'available'
  | 'source'
  | 'utilization_pct'
  | 'memory_used_bytes'
  | 'memory_total_bytes'
  | 'memory_booked_bytes'
  | 'lease_count'
  | 'holders'
>;

/** One host: `state` is `ok`, `stale` or `down`. */
export type IClusterHost = Pick<
  wire.IClusterHostJSON,
  'hostname' | 'state' | 'as_of_s' | 'note'
> & { devices: IClusterDevice[] };

/** A host in ranking order; `chosen`: the labels of the devices it would choose. */
export type IClusterRank = Omit<wire.IHostRank, 'chosen'> & {
  chosen: string[];
};

/** `GET cluster`. */
export type ICluster = Pick<
  wire.IClusterAnswer,
  | 'configured'
  | 'prometheus_url'
  | 'timestamp_s'
  | 'constraints_text'
  | 'best'
  | 'errors'
> & { hosts: IClusterHost[]; ranking: IClusterRank[] };

/** One GPU line of a host. */
export interface IClusterGpuView {
  label: string;
  name: string;
  util: string;
  memory: string;
  holders: string;
  source: string | null;
  lost: boolean;
}

/** A host's mean GPU load over time (`GET cluster/history`), oldest first, null = no data. */
export type IHostHistory = Pick<
  wire.IHostHistoryJSON,
  'hostname' | 'utilization_pct' | 'memory_used_pct'
>;

/** `GET cluster/history`: `hosts` by hostname. */
export type IClusterHistory = Pick<wire.IClusterHistoryAnswer, 'seconds'> & {
  hosts: Map<string, IHostHistory>;
};

/** The history line of a host: a sparkline of the mean utilisation and its summary. */
export interface IHostHistoryView {
  label: string;
  values: (number | null)[];
}

/** One host as the section shows it, best first. */
export interface IClusterHostView {
  hostname: string;
  history: IHostHistoryView | null;
  state: string;
  /** `down`, `stale` or '' for ok hosts. */
  badge: string;
  best: boolean;
  asOf: string;
  note: string | null;
  gpus: IClusterGpuView[];
}

export interface IClusterView {
  /** False when no Prometheus is configured: the section stays hidden. */
  visible: boolean;
  source: string;
  advice: string;
  errors: string[];
  hosts: IClusterHostView[];
}

function fail(what: string, value: unknown): never {
  throw new Error(
    `unexpected ${what} from the server: ${JSON.stringify(value)}`
  );
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function num(value: unknown): number | null {
  return typeof value === 'number' && Number.isFinite(value) ? value : null;
}

function str(value: unknown): string | null {
  return typeof value === 'string' ? value : null;
}

function strings(value: unknown): string[] {
  return Array.isArray(value)
    ? value.filter((v): v is string => typeof v === 'string')
    : [];
}

function parseDevice(raw: unknown): IClusterDevice {
  if (!isObject(raw) || typeof raw.uuid !== 'string') {
    return fail('cluster device', raw);
  }
  return {
    uuid: raw.uuid,
    label: str(raw.label) ?? raw.uuid,
    name: str(raw.name) ?? '',
    available: raw.available !== false,
    source: str(raw.source) ?? 'autogpu',
    utilization_pct: num(raw.utilization_pct),
    memory_used_bytes: num(raw.memory_used_bytes),
    memory_total_bytes: num(raw.memory_total_bytes),
    memory_booked_bytes: num(raw.memory_booked_bytes) ?? 0,
    lease_count: num(raw.lease_count) ?? 0,
    holders: strings(raw.holders)
  };
}

function parseHost(raw: unknown): IClusterHost {
  if (!isObject(raw) || typeof raw.hostname !== 'string') {
    return fail('cluster host', raw);
  }
  return {
    hostname: raw.hostname,
    state: str(raw.state) ?? 'ok',
    as_of_s: num(raw.as_of_s),
    note: str(raw.note),
    devices: Array.isArray(raw.devices) ? raw.devices.map(parseDevice) : []
  };
}

function parseRank(raw: unknown): IClusterRank {
  if (!isObject(raw) || typeof raw.hostname !== 'string') {
    return fail('cluster ranking', raw);
  }
  const chosen = Array.isArray(raw.chosen) ? raw.chosen : [];
  return {
    hostname: raw.hostname,
    fits: raw.fits === true,
    chosen: chosen
      .map(c => (isObject(c) ? str(c.label) : null))
      .filter((c): c is string => c !== null)
  };
}

/** Validate `GET cluster`. Throws an `Error` naming the bad part. */
export function parseCluster(raw: unknown): ICluster {
  if (!isObject(raw) || typeof raw.configured !== 'boolean') {
    return fail('cluster answer', raw);
  }
  return {
    configured: raw.configured,
    prometheus_url: str(raw.prometheus_url),
    timestamp_s: num(raw.timestamp_s) ?? 0,
    constraints_text: str(raw.constraints_text) ?? '',
    hosts: Array.isArray(raw.hosts) ? raw.hosts.map(parseHost) : [],
    ranking: Array.isArray(raw.ranking) ? raw.ranking.map(parseRank) : [],
    best: str(raw.best),
    errors: strings(raw.errors)
  };
}

function numList(value: unknown): (number | null)[] {
  return Array.isArray(value) ? value.map(num) : [];
}

/** Validate `GET cluster/history`. Throws an `Error` naming the bad part. */
export function parseClusterHistory(raw: unknown): IClusterHistory {
  if (!isObject(raw) || !Array.isArray(raw.hosts)) {
    return fail('cluster history', raw);
  }
  const hosts = new Map<string, IHostHistory>();
  for (const h of raw.hosts) {
    if (!isObject(h) || typeof h.hostname !== 'string') {
      return fail('cluster history host', h);
    }
    hosts.set(h.hostname, {
      hostname: h.hostname,
      utilization_pct: numList(h.utilization_pct),
      memory_used_pct: numList(h.memory_used_pct)
    });
  }
  return { seconds: num(raw.seconds) ?? 0, hosts };
}

/** `24 h`, `90 min`, `7 d`: a history window for people. */
export function windowText(
  seconds: number,
  trans: ITrans = noTranslation
): string {
  if (seconds >= 2 * 86400 && seconds % 86400 === 0) {
    return trans.__('%1 d', seconds / 86400);
  }
  if (seconds >= 3600 && seconds % 3600 === 0) {
    return trans.__('%1 h', seconds / 3600);
  }
  return trans.__('%1 min', Math.round(seconds / 60));
}

/** `last 24 h: util mean 28%, max 70%`, from the known points only. */
export function historySummary(
  history: IHostHistory,
  seconds: number,
  trans: ITrans = noTranslation
): string {
  const known = history.utilization_pct.filter((v): v is number => v !== null);
  const window = windowText(seconds, trans);
  if (known.length === 0) {
    return trans.__('last %1: no data', window);
  }
  const mean = known.reduce((a, b) => a + b, 0) / known.length;
  return trans.__(
    'last %1: util mean %2%, max %3%',
    window,
    Math.round(mean),
    Math.round(Math.max(...known))
  );
}

/** `12 s ago`, `5 min ago`, `3 h ago` (never negative: clocks differ a little). */
export function ageText(ageS: number, trans: ITrans = noTranslation): string {
  const s = Math.max(0, Math.round(ageS));
  if (s < 120) {
    return trans.__('%1 s ago', s);
  }
  if (s < 7200) {
    return trans.__('%1 min ago', Math.round(s / 60));
  }
  return trans.__('%1 h ago', Math.round(s / 3600));
}

function clock(timestampS: number): string {
  const d = new Date(timestampS * 1000);
  const two = (n: number) => String(n).padStart(2, '0');
  return `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`;
}

function gpuView(device: IClusterDevice, trans: ITrans): IClusterGpuView {
  const booked =
    device.memory_booked_bytes > 0
      ? ' + ' + trans.__('%1 booked', formatBytes(device.memory_booked_bytes))
      : '';
  return {
    label: device.label,
    name: device.name,
    util: device.available
      ? formatPct(device.utilization_pct, trans)
      : trans.__('lost'),
    memory: device.available
      ? `${formatBytes(device.memory_used_bytes)} / ${formatBytes(
          device.memory_total_bytes
        )}${booked}`
      : '',
    holders: device.holders.join(', '),
    source: device.source === 'autogpu' ? null : device.source,
    lost: !device.available
  };
}

function hostHistory(
  history: IClusterHistory | null,
  hostname: string,
  trans: ITrans
): IHostHistoryView | null {
  const h = history?.hosts.get(hostname);
  if (history === null || h === undefined) {
    return null;
  }
  return {
    label: historySummary(h, history.seconds, trans),
    values: h.utilization_pct
  };
}

/**
 * What the Cluster section shows at `nowS` (Unix seconds): hosts in the server's ranking order
 * (best first; stale and down hosts last), each with its "as of" time and its GPUs.
 */
export function clusterView(
  cluster: ICluster,
  nowS: number,
  history: IClusterHistory | null = null,
  trans: ITrans = noTranslation
): IClusterView {
  if (!cluster.configured) {
    return { visible: false, source: '', advice: '', errors: [], hosts: [] };
  }
  const order = new Map(cluster.ranking.map((r, i) => [r.hostname, i]));
  const hosts = [...cluster.hosts].sort(
    (a, b) =>
      (order.get(a.hostname) ?? order.size) -
        (order.get(b.hostname) ?? order.size) ||
      a.hostname.localeCompare(b.hostname)
  );
  const best = cluster.ranking.find(r => r.hostname === cluster.best);
  const wanted = cluster.constraints_text || trans.__('no constraints');
  let advice: string;
  if (best !== undefined) {
    advice = trans.__(
      'best host for %1: %2 (%3)',
      wanted,
      best.hostname,
      best.chosen.join(', ')
    );
  } else if (cluster.hosts.length > 0) {
    advice = trans.__('no host has a device for %1', wanted);
  } else {
    advice = '';
  }
  return {
    visible: true,
    source: trans.__('from %1', cluster.prometheus_url ?? 'Prometheus'),
    advice,
    errors: cluster.errors,
    hosts: hosts.map(h => ({
      hostname: h.hostname,
      history: hostHistory(history, h.hostname, trans),
      state: h.state,
      badge: h.state === 'ok' ? '' : h.state,
      best: h.hostname === cluster.best,
      asOf:
        h.as_of_s === null
          ? trans.__('no data')
          : trans.__(
              'as of %1 (%2)',
              clock(h.as_of_s),
              ageText(nowS - h.as_of_s, trans)
            ),
      note: h.note,
      gpus: h.devices.map(d => gpuView(d, trans))
    }))
  };
}
