/**
 * Data shaping for the sidebar: parsing the server's JSON, formatting numbers for people,
 * sparkline paths and holder matching. Pure functions, no DOM, no JupyterLab: tested with jest.
 *
 * Field names follow the Python side (units in names, `null` = unknown). The ranking policy is
 * never re-implemented here: recommendations come from the server's dry-run `select`, and the
 * holders come joined by the server (`core/holders.py`, as every other view joins them).
 *
 * Every word shown to people goes through a translation bundle (`ITrans`: JupyterLab's
 * `TranslationBundle`, or `noTranslation` in tests); text from the server is shown as sent.
 */
import type * as wire from './schema';

/** The part of JupyterLab's `TranslationBundle` the sidebar uses. */
export interface ITrans {
  __(msgid: string, ...args: unknown[]): string;
  _n(msgid: string, msgidPlural: string, n: number, ...args: unknown[]): string;
}

function fill(text: string, args: unknown[]): string {
  return text.replace(/%(\d+)/g, (whole, i) =>
    Number(i) >= 1 && Number(i) <= args.length
      ? String(args[Number(i) - 1])
      : whole
  );
}

/** No translation: `%1`, `%2` replaced by the arguments, as JupyterLab's bundles do. */
export const noTranslation: ITrans = {
  __: (msgid: string, ...args: unknown[]) => fill(msgid, args),
  _n: (msgid: string, msgidPlural: string, n: number, ...args: unknown[]) =>
    fill(n === 1 ? msgid : msgidPlural, args)
};

/*
 * The answers' shapes are the wire's, generated from the server's schema
 * (autogpu_jupyter/server/schema.py -> `./schema`, by scripts/wire_schema.py): never written
 * here again. A field added there reaches this file through the generated interface, and the
 * validators below, typed against it, stop compiling until they check it. The sidebar's names
 * for them stay (the rest of the sidebar imports them from here).
 */
export type {
  IBestMoveJSON,
  IBetterDevice,
  IChosenDevice,
  IDeviceJSON,
  IDevicesAnswer,
  IHistoryAnswer,
  IHistorySeries,
  IHolderJSON,
  IHoldersAnswer,
  IKernelJSON,
  IMoveAnswer,
  IProcessJSON,
  ISelectAnswer
} from './schema';

/** A compute process on a device (`command` is null unless the admin exposes it). */
export type IProcess = wire.IProcessJSON;

/** One device at one moment (`DeviceSnapshot.to_dict()`). */
export type IDevice = wire.IDeviceJSON;

/** `GET /autogpu/devices`. */
export type IFleet = wire.IDevicesAnswer;

/** One device's series in `GET /autogpu/history` (oldest first). */
export type ISeries = wire.IHistorySeries;

/** `GET /autogpu/history?since=<ts>`. */
export type IHistory = wire.IHistoryAnswer;

/**
 * Who holds (part of) a device, joined by the server (`core/holders.py`): a lease, a GPU
 * process, or both matched by pid, with this server's kernel and notebook where it knows them.
 * `where` and `memory_text` are the holder in words, as every view says it (`core/words.py`).
 */
export type IHolder = wire.IHolderJSON;

/**
 * One of this server's kernels: can it be moved (autogpu kernelspec), where is it, and where
 * "Move to best GPU" takes it (`best_move`: the server's one decision; null on the best GPU
 * already, or when it cannot move).
 */
export type IKernelInfo = wire.IKernelJSON;

/** A movable kernel's better place, as the server names it (`best_move`). */
export type IBestMove = wire.IBestMoveJSON;

/** `GET /autogpu/holders`. */
export type IHolders = wire.IHoldersAnswer;

/** `POST /autogpu/kernels/<id>/move` (also its dry run, for the confirmation dialog). */
export type IMoveResult = wire.IMoveAnswer;

/** A move button on a card: `best` on the kernel's own device, `here` on the others. */
export interface IMoveAction {
  kind: 'best' | 'here';
  /** The endpoint's `target`: `best` or the device's UUID. */
  target: string;
  label: string;
  title: string;
}

/** A chosen device in a dry-run answer. */
export type IChosen = wire.IChosenDevice;

/**
 * The part of `GET|POST /autogpu/select` (dry run) the recommendation reads; also what
 * `kernelSelection` makes of a kernel's own `best_move`.
 */
export type ISelection = Pick<
  wire.ISelectAnswer,
  'chosen' | 'constraints_text' | 'message' | 'simulated'
>;

/** A holder as the card shows it: the server's words (`where`, `memory_text`). */
export interface IHolderView {
  who: string;
  what: string;
  /** The holder's command where the server sends it (the line's tooltip), else ''. */
  command: string;
  memory: string;
  /** `idle 12 min` for a kernel of this server idle for a minute or more, else ''. */
  idle: string;
  current: boolean;
  exclusive: boolean;
}

/** One user's share of the GPUs, for the totals line. */
export interface IUserTotal {
  user: string;
  devices: number;
  booked_bytes: number;
  used_bytes: number;
}

const UNKNOWN = '–';

function fail(what: string, value: unknown): never {
  throw new Error(
    `unexpected ${what} from the server: ${JSON.stringify(value)}`
  );
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function numOrNull(value: unknown): number | null {
  return typeof value === 'number' && Number.isFinite(value) ? value : null;
}

function strOrNull(value: unknown): string | null {
  return typeof value === 'string' ? value : null;
}

function parseProcess(raw: unknown): IProcess {
  if (!isObject(raw) || typeof raw.pid !== 'number') {
    return fail('process', raw);
  }
  return {
    pid: raw.pid,
    used_memory_bytes: numOrNull(raw.used_memory_bytes),
    user: strOrNull(raw.user),
    command: strOrNull(raw.command)
  };
}

/** Validate one device; unknown or missing fields become `null`. */
export function parseDevice(raw: unknown): IDevice {
  if (
    !isObject(raw) ||
    typeof raw.uuid !== 'string' ||
    typeof raw.index !== 'number'
  ) {
    return fail('device', raw);
  }
  const procs = Array.isArray(raw.processes)
    ? raw.processes.map(parseProcess)
    : null;
  return {
    index: raw.index,
    uuid: raw.uuid,
    name: typeof raw.name === 'string' ? raw.name : 'GPU',
    label: typeof raw.label === 'string' ? raw.label : `GPU ${raw.index}`,
    pci_bus_id: strOrNull(raw.pci_bus_id),
    memory_total_bytes: numOrNull(raw.memory_total_bytes),
    memory_used_bytes: numOrNull(raw.memory_used_bytes),
    memory_free_bytes: numOrNull(raw.memory_free_bytes),
    utilization_pct: numOrNull(raw.utilization_pct),
    memory_utilization_pct: numOrNull(raw.memory_utilization_pct),
    temperature_c: numOrNull(raw.temperature_c),
    power_w: numOrNull(raw.power_w),
    power_limit_w: numOrNull(raw.power_limit_w),
    compute_mode: strOrNull(raw.compute_mode),
    is_mig: raw.is_mig === true,
    mig_enabled: typeof raw.mig_enabled === 'boolean' ? raw.mig_enabled : null,
    parent_uuid: strOrNull(raw.parent_uuid),
    mig_index: numOrNull(raw.mig_index),
    processes: procs,
    available: raw.available !== false,
    error: strOrNull(raw.error),
    vendor: typeof raw.vendor === 'string' ? raw.vendor : 'nvidia',
    runtime_uuid: strOrNull(raw.runtime_uuid),
    timestamp_s: numOrNull(raw.timestamp_s) ?? 0
  };
}

function stringList(value: unknown): string[] {
  return Array.isArray(value)
    ? value.filter((v): v is string => typeof v === 'string')
    : [];
}

/** Validate `GET devices`. Throws an `Error` naming the bad part. */
export function parseFleet(raw: unknown): IFleet {
  if (!isObject(raw) || !Array.isArray(raw.devices)) {
    return fail('devices answer', raw);
  }
  return {
    timestamp_s: numOrNull(raw.timestamp_s) ?? 0,
    backend: strOrNull(raw.backend),
    simulated: raw.simulated === true,
    driver_version: strOrNull(raw.driver_version),
    errors: stringList(raw.errors),
    devices: raw.devices.map(parseDevice),
    interval_s: numOrNull(raw.interval_s) ?? 1
  };
}

/** Bytes for people, binary units as the rest of autogpu: `12.5 GiB`; null gives `–`. */
export function formatBytes(n: number | null): string {
  if (n === null || !Number.isFinite(n)) {
    return UNKNOWN;
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let value = n;
  let i = 0;
  while (Math.abs(value) >= 1024 && i < units.length - 1) {
    value /= 1024;
    i += 1;
  }
  return i === 0 ? `${value} B` : `${value.toFixed(1)} ${units[i]}`;
}

/** `35%`; null (NOT_SUPPORTED, e.g. MIG) gives `n/a`. */
export function formatPct(
  value: number | null,
  trans: ITrans = noTranslation
): string {
  return value === null ? trans.__('n/a') : `${Math.round(value)}%`;
}

/** `51 °C · 210 W / 400 W`, leaving out what the device does not report; '' when nothing. */
export function formatThermals(device: IDevice): string {
  const parts: string[] = [];
  if (device.temperature_c !== null) {
    parts.push(`${Math.round(device.temperature_c)} °C`);
  }
  if (device.power_w !== null) {
    const limit =
      device.power_limit_w !== null
        ? ` / ${Math.round(device.power_limit_w)} W`
        : '';
    parts.push(`${Math.round(device.power_w)} W${limit}`);
  }
  return parts.join(' · ');
}

/** `20.0 GiB / 80.0 GiB`, or `–` parts when unknown. */
export function formatMemory(device: IDevice): string {
  return `${formatBytes(device.memory_used_bytes)} / ${formatBytes(
    device.memory_total_bytes
  )}`;
}

/** The state of a card: `lost` (fell off the bus / unreadable) or `ok`. */
export function deviceState(device: IDevice): 'ok' | 'lost' {
  return device.available ? 'ok' : 'lost';
}

/** What the card says about unknown readings, e.g. `utilisation not supported`. */
export function unsupportedNote(
  device: IDevice,
  trans: ITrans = noTranslation
): string | null {
  if (!device.available) {
    return null;
  }
  const util = device.utilization_pct === null;
  const mem = device.memory_total_bytes === null;
  if (util && mem) {
    return trans.__('utilisation and memory not supported');
  }
  if (util) {
    return trans.__('utilisation not supported');
  }
  return mem ? trans.__('memory not supported') : null;
}

/**
 * An SVG path (`M x,y L x,y ...`) through `values` in a `width` x `height` box, 0 at the bottom
 * and `max` at the top. `null` values break the line (a new `M` after the gap). The newest value
 * sits at the right edge; `slots` fixes the horizontal scale (default: the number of values);
 * `pad` pixels are kept free above max and below 0.
 */
export function sparklinePath(
  values: (number | null)[],
  width: number,
  height: number,
  max: number,
  slots?: number,
  pad = 0
): string {
  const n = Math.max(slots ?? values.length, 2);
  const step = width / (n - 1);
  const offset = n - values.length;
  const parts: string[] = [];
  let drawing = false;
  values.forEach((v, i) => {
    if (v === null || !Number.isFinite(v) || max <= 0) {
      drawing = false;
      return;
    }
    const clamped = Math.min(Math.max(v, 0), max);
    const x = round2((offset + i) * step);
    // `pad` keeps 0 and max inside the box, visible, instead of on its edge
    const y = round2(height - pad - (clamped / max) * (height - 2 * pad));
    parts.push(`${drawing ? 'L' : 'M'}${x},${y}`);
    drawing = true;
  });
  return parts.join(' ');
}

function round2(v: number): number {
  return Math.round(v * 100) / 100;
}

/**
 * Merge a `history?since=` answer into the series kept so far, keeping the newest `maxPoints`
 * per device; devices absent from `incoming` keep their series.
 */
export function mergeHistory(
  kept: Map<string, ISeries>,
  incoming: IHistory,
  maxPoints: number
): Map<string, ISeries> {
  const out = new Map(kept);
  for (const s of incoming.series) {
    const prev = out.get(s.uuid);
    const ts = (prev ? prev.timestamp_s : []).concat(s.timestamp_s);
    const util = (prev ? prev.utilization_pct : []).concat(s.utilization_pct);
    const mem = (prev ? prev.memory_used_bytes : []).concat(
      s.memory_used_bytes
    );
    const drop = Math.max(ts.length - maxPoints, 0);
    out.set(s.uuid, {
      uuid: s.uuid,
      timestamp_s: ts.slice(drop),
      utilization_pct: util.slice(drop),
      memory_used_bytes: mem.slice(drop),
      memory_total_bytes:
        s.memory_total_bytes ?? (prev ? prev.memory_total_bytes : null)
    });
  }
  return out;
}

/** Validate `GET history`. */
export function parseHistory(raw: unknown): IHistory {
  if (!isObject(raw) || !Array.isArray(raw.series)) {
    return fail('history answer', raw);
  }
  const series = raw.series.map((s: unknown): ISeries => {
    if (
      !isObject(s) ||
      typeof s.uuid !== 'string' ||
      !Array.isArray(s.timestamp_s)
    ) {
      return fail('history series', s);
    }
    const nums = (v: unknown): (number | null)[] =>
      Array.isArray(v) ? v.map(numOrNull) : [];
    return {
      uuid: s.uuid,
      timestamp_s: s.timestamp_s.map(t => numOrNull(t) ?? 0),
      utilization_pct: nums(s.utilization_pct),
      memory_used_bytes: nums(s.memory_used_bytes),
      memory_total_bytes: numOrNull(s.memory_total_bytes)
    };
  });
  return {
    interval_s: numOrNull(raw.interval_s) ?? 1,
    history_s: numOrNull(raw.history_s) ?? 0,
    since_s: numOrNull(raw.since_s),
    until_s: numOrNull(raw.until_s),
    series,
    errors: stringList(raw.errors)
  };
}

/** Validate `GET holders`. */
export function parseHolders(raw: unknown): IHolders {
  if (!isObject(raw) || !Array.isArray(raw.holders)) {
    return fail('holders answer', raw);
  }
  const holders = raw.holders.map((h: unknown): IHolder => {
    if (!isObject(h) || typeof h.uuid !== 'string') {
      return fail('holder', h);
    }
    return {
      kind:
        h.kind === 'lease' || h.kind === 'lease+process' ? h.kind : 'process',
      uuid: h.uuid,
      label: typeof h.label === 'string' ? h.label : h.uuid,
      user: strOrNull(h.user),
      pid: numOrNull(h.pid),
      kernel_id: strOrNull(h.kernel_id),
      this_server: h.this_server === true,
      notebook_path: strOrNull(h.notebook_path),
      booked_bytes: numOrNull(h.booked_bytes),
      used_memory_bytes: numOrNull(h.used_memory_bytes),
      exclusive: h.exclusive === true,
      created_s: numOrNull(h.created_s),
      command: strOrNull(h.command),
      where: typeof h.where === 'string' ? h.where : '?',
      memory_text: typeof h.memory_text === 'string' ? h.memory_text : ''
    };
  });
  const kernels = Array.isArray(raw.kernels)
    ? raw.kernels.map((k: unknown): IKernelInfo => {
        if (!isObject(k) || typeof k.kernel_id !== 'string') {
          return fail('kernel', k);
        }
        return {
          kernel_id: k.kernel_id,
          notebook_path: strOrNull(k.notebook_path),
          execution_state: strOrNull(k.execution_state),
          idle_s: numOrNull(k.idle_s),
          movable: k.movable === true,
          picked_uuids: stringList(k.picked_uuids),
          constraints_text: strOrNull(k.constraints_text),
          note: strOrNull(k.note),
          overload: strOrNull(k.overload),
          better:
            isObject(k.better) &&
            typeof k.better.uuid === 'string' &&
            typeof k.better.label === 'string'
              ? { uuid: k.better.uuid, label: k.better.label }
              : null,
          waiting: k.waiting === true,
          allowed_uuids: Array.isArray(k.allowed_uuids)
            ? stringList(k.allowed_uuids)
            : null,
          best_move: parseBestMove(k.best_move),
          cull_warning: strOrNull(k.cull_warning)
        };
      })
    : [];
  return {
    timestamp_s: numOrNull(raw.timestamp_s) ?? 0,
    simulated: raw.simulated === true,
    user: typeof raw.user === 'string' ? raw.user : '',
    holders,
    kernels,
    errors: stringList(raw.errors)
  };
}

function parseBestMove(raw: unknown): IBestMove | null {
  if (!isObject(raw) || typeof raw.target !== 'string' || raw.target === '') {
    return null;
  }
  const uuids = stringList(raw.uuids);
  const labels = stringList(raw.labels);
  return uuids.length
    ? { target: raw.target, uuids, labels: labels.length ? labels : uuids }
    : null;
}

/** The kernel `kernelId` among this server's kernels, or null. */
export function kernelInfoFor(
  holders: IHolders | null,
  kernelId: string | null
): IKernelInfo | null {
  if (holders === null || kernelId === null) {
    return null;
  }
  return holders.kernels.find(k => k.kernel_id === kernelId) ?? null;
}

/**
 * The move button a card shows for the active notebook's kernel, or null. Only a kernel
 * started by the autogpu kernelspec can move (its provisioner picks again at the restart);
 * lost devices offer nothing; a kernel on several GPUs offers only "best" (a move names as
 * many devices as it uses).
 */
export function moveActionFor(
  device: IDevice,
  kernel: IKernelInfo | null,
  trans: ITrans = noTranslation
): IMoveAction | null {
  if (kernel === null || !kernel.movable || !device.available) {
    return null;
  }
  if (kernel.picked_uuids.includes(device.uuid)) {
    // only where the server's one decision names a better GPU than the kernel's own: never a
    // move away from the best GPU (and back again)
    const best = kernel.best_move;
    if (best === null) {
      return null;
    }
    return {
      kind: 'best',
      target: best.target,
      label: trans.__('Move to best GPU'),
      title: trans.__(
        "Restart this notebook's kernel on %1, the best GPU now (its variables are lost)",
        best.labels.join(', ')
      )
    };
  }
  if (kernel.picked_uuids.length > 1) {
    return null;
  }
  return {
    kind: 'here',
    target: device.uuid,
    label: trans.__('Move here'),
    title: trans.__(
      "Restart this notebook's kernel on %1 (its variables are lost)",
      device.label
    )
  };
}

/** Validate a move answer. */
export function parseMoveResult(raw: unknown): IMoveResult {
  if (!isObject(raw) || typeof raw.message !== 'string') {
    return fail('move answer', raw);
  }
  return {
    dry_run: raw.dry_run === true,
    message: raw.message,
    plan: typeof raw.plan === 'string' ? raw.plan : raw.message,
    target: stringList(raw.target),
    target_labels: stringList(raw.target_labels),
    picked: Array.isArray(raw.picked) ? stringList(raw.picked) : null,
    note: strOrNull(raw.note),
    pending: raw.pending === true
  };
}

/** The confirm button of the move dialog: `Restart on GPU 2`. */
export function confirmLabel(
  plan: IMoveResult,
  trans: ITrans = noTranslation
): string {
  return plan.target_labels.length
    ? trans.__('Restart on %1', plan.target_labels.join(', '))
    : trans.__('Restart on the new GPU');
}

/**
 * The dry-run `select` path for the recommendation: the sidebar's min free, and the active
 * notebook's kernel so that its own lease does not count against the device it holds.
 */
export function selectPath(minFree: string, kernelId: string | null): string {
  const params: string[] = [];
  const wanted = minFree.trim();
  if (wanted) {
    params.push(`min_free=${encodeURIComponent(wanted)}`);
  }
  if (kernelId) {
    params.push(`kernel_id=${encodeURIComponent(kernelId)}`);
  }
  return params.length ? `select?${params.join('&')}` : 'select';
}

/** Validate `select`. */
export function parseSelection(raw: unknown): ISelection {
  if (!isObject(raw) || !Array.isArray(raw.chosen)) {
    return fail('select answer', raw);
  }
  return {
    chosen: raw.chosen.map((c: unknown): IChosen => {
      if (!isObject(c) || typeof c.uuid !== 'string') {
        return fail('chosen device', c);
      }
      return {
        uuid: c.uuid,
        label: typeof c.label === 'string' ? c.label : c.uuid,
        name: typeof c.name === 'string' ? c.name : ''
      };
    }),
    constraints_text:
      typeof raw.constraints_text === 'string' ? raw.constraints_text : '',
    message: strOrNull(raw.message),
    simulated: raw.simulated === true
  };
}

/**
 * The one word every view shows for a device nobody holds (`core/holders.py`'s `NOBODY`:
 * `%gpu status`, `autogpu list` and the panel say it too).
 */
export function nobodyText(trans: ITrans = noTranslation): string {
  return trans.__('nobody');
}

/**
 * The holders of device `uuid`, as the card lists them: the server's joined holders
 * (`core/holders.py`), one line each, in the server's words (`core/words.py`: every view
 * words a holder alike). The holder whose kernel is `currentKernelId`
 * (the active notebook's) is marked `current` and comes first.
 */
export function holdersFor(
  holders: IHolder[],
  uuid: string,
  currentKernelId: string | null,
  kernels: IKernelInfo[] = [],
  trans: ITrans = noTranslation
): IHolderView[] {
  const idleOf = new Map(kernels.map(k => [k.kernel_id, k.idle_s]));
  const views = holders
    .filter(h => h.uuid === uuid)
    .map(h => {
      return {
        who: h.user ?? trans.__('unknown user'),
        what: h.where,
        command: h.command ?? '',
        memory: h.memory_text,
        idle: formatIdle(
          h.kernel_id !== null ? (idleOf.get(h.kernel_id) ?? null) : null,
          trans
        ),
        current: currentKernelId !== null && h.kernel_id === currentKernelId,
        exclusive: h.exclusive
      };
    });
  // stable: the server's order within each group
  return views.sort((a, b) => Number(b.current) - Number(a.current));
}

/** `best device for 10.0 GiB: GPU 3`, or why none fits. */
export function recommendationText(
  selection: ISelection,
  current: string[] = [],
  trans: ITrans = noTranslation
): string {
  const wanted = selection.constraints_text.replace(/^min free /, '');
  const any =
    selection.constraints_text === 'no constraints' ||
    selection.constraints_text === '';
  if (selection.chosen.length === 0) {
    return (
      selection.message ??
      trans.__('no device fits (%1)', selection.constraints_text)
    );
  }
  // A label never breaks ("GPU" at the end of a line, "2" on the next): no-break spaces.
  const labels = selection.chosen
    .map(c => c.label.replace(/ /g, '\u00a0'))
    .join(', ');
  if (selection.chosen.every(c => current.includes(c.uuid))) {
    return any
      ? trans.__('you are already on the best device now: %1', labels)
      : trans.__(
          'you are already on the best device for %1: %2',
          wanted,
          labels
        );
  }
  return any
    ? trans.__('best device now: %1', labels)
    : trans.__('best device for %1: %2', wanted, labels);
}

/**
 * The recommendation for the active notebook. A kernel started by the autogpu kernelspec that
 * holds a GPU is told the server's own decision for it (`best_move`: its options, its own
 * lease left out), so that the line, the "best" badge and "Move to best GPU" say one thing;
 * any other notebook, the sidebar's `select`.
 */
export function kernelSelection(
  selection: ISelection | null,
  kernel: IKernelInfo | null,
  devices: IDevice[]
): ISelection | null {
  if (kernel === null || !kernel.movable || kernel.picked_uuids.length === 0) {
    return selection;
  }
  const named = (uuid: string, label: string | undefined) => {
    const device = devices.find(d => d.uuid === uuid);
    return {
      uuid,
      label: label ?? device?.label ?? uuid,
      name: device?.name ?? ''
    };
  };
  const best = kernel.best_move;
  return {
    chosen: best
      ? best.uuids.map((u, i) => named(u, best.labels[i]))
      : kernel.picked_uuids.map(u => named(u, undefined)),
    constraints_text:
      kernel.constraints_text ?? selection?.constraints_text ?? '',
    message: null,
    simulated: selection?.simulated ?? false
  };
}

/** The button of the recommendation line: pick or move the active notebook there. */
export interface IRecommendationAction {
  kind: 'pick' | 'move';
  /** The device(s) by label: `GPU 2`. */
  where: string;
  label: string;
  title: string;
  /** `move`: the endpoint's target (`best` or a UUID). */
  target: string;
  /** `pick`: the device, and the code the notebook's kernel runs (as the card's Pick). */
  uuid: string;
  code: string;
}

/**
 * The action the recommendation line carries for the active notebook (issue 41: the first
 * button a newcomer clicked was GPU 0's Pick, on a 98 %-busy card): "Move to GPU 2" for a
 * kernel of the autogpu kernelspec where the server names a better GPU (`best_move`), "Pick
 * GPU 2" for a notebook that holds no GPU yet and may pick the recommended one; else null
 * (on the best GPU already, or nothing it could do).
 */
export function recommendationAction(
  selection: ISelection | null,
  kernel: IKernelInfo | null,
  holders: IHolders | null,
  kernelId: string | null,
  devices: IDevice[],
  trans: ITrans = noTranslation
): IRecommendationAction | null {
  if (kernelId === null) {
    return null;
  }
  if (kernel !== null && kernel.movable) {
    let target: string | null = null;
    let labels: string[] = [];
    if (kernel.best_move !== null) {
      target = kernel.best_move.target;
      labels = kernel.best_move.labels;
    } else if (
      kernel.picked_uuids.length === 0 &&
      selection !== null &&
      selection.chosen.length === 1
    ) {
      // an autogpu kernel without a GPU: a restart on the recommended one
      target = selection.chosen[0].uuid;
      labels = [selection.chosen[0].label];
    }
    if (target === null) {
      return null;
    }
    const where = labels.join(', ');
    return {
      kind: 'move',
      where,
      label: trans.__('Move to %1', where),
      title: trans.__(
        "Restart this notebook's kernel on %1 (its variables are lost)",
        where
      ),
      target,
      uuid: '',
      code: ''
    };
  }
  if (selection === null || selection.chosen.length !== 1) {
    return null;
  }
  const device = devices.find(d => d.uuid === selection.chosen[0].uuid);
  const code =
    device === undefined
      ? null
      : pickCodeFor(device, kernel, holders, kernelId);
  if (device === undefined || code === null) {
    return null;
  }
  return {
    kind: 'pick',
    where: device.label,
    label: trans.__('Pick %1', device.label),
    title: trans.__(
      "Pick %1 for this notebook: %gpu pick in the notebook's own kernel, on this GPU only",
      device.label
    ),
    target: '',
    uuid: device.uuid,
    code
  };
}

/**
 * What the sidebar says on top for a notebook whose GPU other processes overload: the
 * server's words, the same as the notification's, and the better device they name (the card
 * that gets the "best" badge). Null when the kernel is not overloaded.
 */
export function overloadAdvice(
  kernel: IKernelInfo | null
): { text: string; uuid: string | null } | null {
  if (kernel === null || kernel.overload === null) {
    return null;
  }
  return { text: kernel.overload, uuid: kernel.better?.uuid ?? null };
}

/** The errors of one refresh, each said once (the devices, holders and select answers often
 * carry the same sampler error). */
export function uniqueErrors(errors: string[]): string[] {
  return [...new Set(errors.map(e => e.trim()).filter(e => e !== ''))];
}

/**
 * The devices a notebook's kernel holds or uses: its leases and processes in `holders`, and
 * the autogpu provisioner's pick. What "you are already on it" compares with.
 */
export function notebookDevices(
  holders: IHolders | null,
  kernelId: string | null
): string[] {
  if (holders === null || kernelId === null) {
    return [];
  }
  const out = new Set<string>();
  for (const h of holders.holders) {
    if (h.kernel_id === kernelId) {
      out.add(h.uuid);
    }
  }
  for (const u of kernelInfoFor(holders, kernelId)?.picked_uuids ?? []) {
    out.add(u);
  }
  return [...out];
}

/** `idle 12 min`, `idle 2 h 5 min`; '' under a minute or when unknown (not worth a word). */
export function formatIdle(
  idleS: number | null,
  trans: ITrans = noTranslation
): string {
  if (idleS === null || !Number.isFinite(idleS) || idleS < 60) {
    return '';
  }
  const minutes = Math.floor(idleS / 60);
  if (minutes < 60) {
    return trans.__('idle %1 min', minutes);
  }
  const hours = Math.floor(minutes / 60);
  const rest = minutes % 60;
  return rest
    ? trans.__('idle %1 h %2 min', hours, rest)
    : trans.__('idle %1 h', hours);
}

/**
 * Per user: how many devices they hold (a lease or a process on it), the memory their leases
 * book and their processes use. Sorted by memory, largest first; unknown users as `unknown`.
 */
export function userTotals(holders: IHolder[]): IUserTotal[] {
  const byUser = new Map<
    string,
    { devices: Set<string>; booked: number; used: number }
  >();
  for (const h of holders) {
    const user = h.user ?? 'unknown';
    const entry = byUser.get(user) ?? {
      devices: new Set<string>(),
      booked: 0,
      used: 0
    };
    entry.devices.add(h.uuid);
    entry.booked += h.booked_bytes ?? 0;
    entry.used += h.used_memory_bytes ?? 0;
    byUser.set(user, entry);
  }
  return [...byUser.entries()]
    .map(([user, e]) => ({
      user,
      devices: e.devices.size,
      booked_bytes: e.booked,
      used_bytes: e.used
    }))
    .sort(
      (a, b) =>
        Math.max(b.booked_bytes, b.used_bytes) -
          Math.max(a.booked_bytes, a.used_bytes) || a.user.localeCompare(b.user)
    );
}

/** `alice: 2 GPUs, 30.0 GiB booked, 12.0 GiB used`. */
export function formatUserTotal(
  total: IUserTotal,
  trans: ITrans = noTranslation
): string {
  const parts = [trans._n('%1 GPU', '%1 GPUs', total.devices, total.devices)];
  if (total.booked_bytes > 0) {
    parts.push(trans.__('%1 booked', formatBytes(total.booked_bytes)));
  }
  if (total.used_bytes > 0) {
    parts.push(trans.__('%1 used', formatBytes(total.used_bytes)));
  }
  return `${total.user}: ${parts.join(', ')}`;
}

/**
 * The devices that are "mine": held by the server's user (`holders.user`, the one who runs
 * this JupyterLab) or by the active notebook's kernel.
 */
export function myDevices(
  holders: IHolders | null,
  kernelId: string | null
): Set<string> {
  const mine = new Set<string>();
  if (holders === null) {
    return mine;
  }
  for (const h of holders.holders) {
    if (
      (holders.user !== '' && h.user === holders.user) ||
      (kernelId !== null && h.kernel_id === kernelId)
    ) {
      mine.add(h.uuid);
    }
  }
  return mine;
}

/** The label at the top of a sparkline's scale: `100%`, or the device's memory `80 GiB`. */
export function sparkScaleTop(kind: 'util' | 'mem', max: number): string {
  if (kind === 'util') {
    return '100%';
  }
  if (!(max > 0)) {
    return '';
  }
  const gib = max / 1024 ** 3;
  return gib >= 1 ? `${Math.round(gib)} GiB` : formatBytes(max);
}

/**
 * Which overload notifications to show now: the active kernel's warning when it is new (not
 * shown for this kernel yet). `shown` maps kernel id to the warning's device part; a kernel
 * whose overload cleared is forgotten, so that a new overload is announced again.
 */
export function overloadToNotify(
  kernel: IKernelInfo | null,
  shown: Map<string, string>
): string | null {
  if (kernel === null) {
    return null;
  }
  if (kernel.overload === null) {
    shown.delete(kernel.kernel_id);
    return null;
  }
  // "autogpu: GPU 1 (this kernel's GPU) is overloaded: ..." -> "GPU 1": numbers move, the
  // device does not
  const key = kernel.overload.split(' (this kernel')[0];
  if (shown.get(kernel.kernel_id) === key) {
    return null;
  }
  shown.set(kernel.kernel_id, key);
  return kernel.overload;
}

/**
 * The kernels whose wait in line ended with a GPU since the last answer: waiting before
 * (`waitingBefore`, updated in place to the kernels waiting now) and holding a lease now.
 * Each as the notification says it: `train.ipynb got its GPU: GPU 2 (it waited in line)`.
 */
export function waitsEnded(
  holders: IHolders,
  waitingBefore: Set<string>,
  trans: ITrans = noTranslation
): string[] {
  const out: string[] = [];
  for (const k of holders.kernels) {
    if (k.waiting || !waitingBefore.has(k.kernel_id)) {
      continue;
    }
    const labels = holders.holders
      .filter(
        h =>
          h.kind !== 'process' && h.this_server && h.kernel_id === k.kernel_id
      )
      .map(h => h.label);
    if (labels.length > 0) {
      const who =
        k.notebook_path ?? trans.__('kernel %1', k.kernel_id.slice(0, 8));
      out.push(
        trans.__(
          '%1 got its GPU: %2 (it waited in line)',
          who,
          labels.join(', ')
        )
      );
    }
  }
  waitingBefore.clear();
  for (const k of holders.kernels) {
    if (k.waiting) {
      waitingBefore.add(k.kernel_id);
    }
  }
  return out;
}

/**
 * The "Pick for this notebook" action of a card, or null: for the active notebook's plain
 * kernel (not the autogpu kernelspec, which picks before it starts) that holds no GPU yet, on a
 * live device inside the kernel's allocation. The pick runs *in that kernel*
 * (`autogpu_jupyter.magics.sidebar_pick`: `%gpu pick` on that one device, the extension loaded
 * quietly, no waiting in line), so the variables are set in its process, with a lease, and
 * refused there if CUDA already started. Its answer is a display of `PICK_MIME`.
 */
export function pickCodeFor(
  device: IDevice,
  kernel: IKernelInfo | null,
  holders: IHolders | null,
  kernelId: string | null
): string | null {
  if (kernelId === null || !device.available || device.is_mig) {
    return null;
  }
  if (kernel !== null && kernel.movable) {
    return null;
  }
  if (
    kernel !== null &&
    kernel.allowed_uuids !== null &&
    !kernel.allowed_uuids.includes(device.uuid)
  ) {
    return null; // outside the devices its process may use: a pick would only be refused
  }
  if (holders?.holders.some(h => h.kernel_id === kernelId)) {
    return null;
  }
  // JSON's string syntax is Python's for these characters: the UUID arrives as one literal
  return `__import__("autogpu_jupyter.magics", fromlist=["sidebar_pick"]).sidebar_pick(${JSON.stringify(
    device.uuid
  )})`;
}

/** The MIME type of the kernel's answer to the sidebar's pick. */
export const PICK_MIME = 'application/vnd.autogpu.pick+json';

/** The kernel's answer to the sidebar's pick: one line, and the rest behind a toggle. */
export interface IPickOutcome {
  ok: boolean;
  summary: string;
  details: string;
}

/** Validate the pick's answer (the `PICK_MIME` data of the kernel's display). */
export function parsePickOutcome(raw: unknown): IPickOutcome {
  if (!isObject(raw) || typeof raw.summary !== 'string') {
    return fail('pick answer', raw);
  }
  return {
    ok: raw.ok === true,
    summary: raw.summary,
    details: typeof raw.details === 'string' ? raw.details : ''
  };
}

/** What the status bar shows for the active notebook's GPU. */
export interface IGPUStatus {
  /** `GPU 2 · 35% · 20.0 GiB / 80.0 GiB`, one part per device. */
  text: string;
  /** The tooltip: the overload or cull warning when there is one, else what the item is. */
  title: string;
  overloaded: boolean;
}

/**
 * The status-bar item of the active notebook (issue 41): the GPU(s) its kernel holds, their
 * utilisation and memory from the server's `devices` and `holders` answers, and a warning mark
 * when the server says other processes overload them. Null (no item) for a notebook whose
 * kernel holds no GPU, or when nothing is known yet.
 */
export function gpuStatus(
  holders: IHolders | null,
  fleet: IFleet | null,
  kernelId: string | null,
  trans: ITrans = noTranslation
): IGPUStatus | null {
  if (holders === null || fleet === null || kernelId === null) {
    return null;
  }
  const devices = notebookDevices(holders, kernelId)
    .map(u => fleet.devices.find(d => d.uuid === u))
    .filter((d): d is IDevice => d !== undefined);
  if (devices.length === 0) {
    return null;
  }
  const kernel = kernelInfoFor(holders, kernelId);
  const overloaded = kernel !== null && kernel.overload !== null;
  const parts = devices.map(d =>
    d.available
      ? trans.__(
          '%1 · %2 · %3',
          d.label,
          formatPct(d.utilization_pct, trans),
          formatMemory(d)
        )
      : trans.__('%1 · lost', d.label)
  );
  const labels = devices.map(d => d.label).join(', ');
  const warning = kernel?.overload ?? kernel?.cull_warning ?? null;
  return {
    text: parts.join(' | '),
    title:
      warning ??
      trans.__(
        "This notebook's GPU: %1. Click to open the GPU sidebar.",
        labels
      ),
    overloaded
  };
}

/**
 * The cull warning to show now for the active notebook's kernel, once per idle stretch: the
 * server's words, the first time it gives them (`shown` remembers it per kernel until the
 * warning ends, when the kernel was active again).
 */
export function cullWarningToNotify(
  kernel: IKernelInfo | null,
  shown: Set<string>
): string | null {
  if (kernel === null) {
    return null;
  }
  if (kernel.cull_warning === null) {
    shown.delete(kernel.kernel_id);
    return null;
  }
  if (shown.has(kernel.kernel_id)) {
    return null;
  }
  shown.add(kernel.kernel_id);
  return kernel.cull_warning;
}
