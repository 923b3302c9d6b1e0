/**
 * autogpu's sidebar: every GPU on the server, live, who holds it, and which one the active
 * notebook should pick. The data comes from the server extension (`{base_url}/autogpu/api/v1/`).
 *
 * It runs in JupyterLab (the left sidebar, with the other panels) and in Notebook 7, whose shell
 * has a left area too but no `ILabShell`: there the panel is added through `app.shell` and shown
 * from View → Left Sidebar → Show GPUs (autogpu).
 *
 * The active notebook's GPU is also shown in JupyterLab's status bar (`IStatusBar`), and in
 * Notebook 7, which has no status bar, in its top bar; a click opens the sidebar.
 */
import {
  ILabShell,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { INotebookTracker } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { ITranslator, nullTranslator } from '@jupyterlab/translation';
import { LabIcon } from '@jupyterlab/ui-components';

import gpuSvg from '../style/icons/gpu.svg';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import {
  GPUPanel,
  IActiveNotebook,
  IExecuteResult,
  IPanelSettings
} from './panel';
import { PICK_MIME, parsePickOutcome } from './model';
import { GPUStatusItem } from './statusbar';

/** The sidebar's icon. */
export const gpuIcon = new LabIcon({ name: 'autogpu:gpu', svgstr: gpuSvg });

const PLUGIN_ID = 'autogpu-jupyter:plugin';

// eslint-disable-next-line no-control-regex
const ANSI = /\x1b\[[0-9;]*m/g;

/**
 * Run `code` in `kernel` (not stored in its history): what it printed, whether it failed, and
 * the sidebar pick's answer when the code displayed one (`PICK_MIME`).
 */
async function executeIn(
  kernel: Kernel.IKernelConnection,
  code: string
): Promise<IExecuteResult> {
  const parts: string[] = [];
  let pick: IExecuteResult['pick'] = null;
  const future = kernel.requestExecute({ code, store_history: false });
  future.onIOPub = (msg: KernelMessage.IIOPubMessage) => {
    if (KernelMessage.isStreamMsg(msg)) {
      parts.push(msg.content.text);
    } else if (KernelMessage.isErrorMsg(msg)) {
      parts.push(msg.content.traceback.join('\n').replace(ANSI, '') + '\n');
    } else if (
      KernelMessage.isDisplayDataMsg(msg) &&
      msg.content.data[PICK_MIME] !== undefined
    ) {
      try {
        pick = parsePickOutcome(msg.content.data[PICK_MIME]);
      } catch (reason) {
        parts.push(`${reason}\n`);
      }
    }
  };
  const reply = await future.done;
  return { ok: reply.content.status === 'ok', text: parts.join(''), pick };
}

function readSettings(settings: ISettingRegistry.ISettings): IPanelSettings {
  const get = <T>(key: string, fallback: T): T => {
    const value = settings.get(key).composite;
    return value === undefined || value === null ? fallback : (value as T);
  };
  return {
    refreshInterval: get<number>('refreshInterval', 2),
    recommendMinFree: get<string>('recommendMinFree', '10G'),
    historyPoints: get<number>('historyPoints', 120)
  };
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'A left-sidebar panel with every GPU on the server, its holders and a recommendation.',
  autoStart: true,
  optional: [
    ILabShell,
    ISettingRegistry,
    INotebookTracker,
    ITranslator,
    IStatusBar
  ],
  activate: (
    app: JupyterFrontEnd,
    labShell: ILabShell | null,
    settingRegistry: ISettingRegistry | null,
    tracker: INotebookTracker | null,
    translator: ITranslator | null,
    statusBar: IStatusBar | null
  ) => {
    const activeNotebook = (): IActiveNotebook | null => {
      const current = tracker?.currentWidget ?? null;
      if (current === null) {
        return null;
      }
      const kernel = current.sessionContext.session?.kernel ?? null;
      return {
        path: current.context.path,
        kernelId: kernel?.id ?? null,
        execute: kernel === null ? undefined : code => executeIn(kernel, code),
        // JupyterLab's own restart (as Kernel > Restart Kernel, without its dialog): the
        // notebook follows it, and its kernel indicator is Idle once the kernel is back
        restart: () => current.sessionContext.restartKernel()
      };
    };
    const panel = new GPUPanel({
      serverSettings: app.serviceManager.serverSettings,
      activeNotebook,
      translator: translator ?? undefined
    });
    panel.title.icon = gpuIcon;
    panel.title.caption = (translator ?? nullTranslator)
      .load('autogpu_jupyter')
      .__('GPUs (autogpu)');
    // JupyterLab's shell, or any shell with a left area (Notebook 7's INotebookShell).
    (labShell ?? app.shell).add(panel, 'left', { rank: 850 });
    // The active notebook's GPU: JupyterLab's status bar, or Notebook 7's top bar.
    const status =
      tracker === null
        ? null
        : new GPUStatusItem({
            serverSettings: app.serviceManager.serverSettings,
            activeKernelId: () =>
              tracker.currentWidget?.sessionContext.session?.kernel?.id ?? null,
            openSidebar: () => app.shell.activateById(panel.id),
            translator: translator ?? undefined
          });
    if (status !== null) {
      if (statusBar !== null) {
        statusBar.registerStatusItem('autogpu-jupyter:status', {
          item: status,
          align: 'left',
          rank: 50,
          isActive: () => status.active,
          activeStateChanged: status.activeChanged
        });
      } else if (labShell === null) {
        app.shell.add(status, 'top', { rank: 10000 });
      }
    }
    tracker?.currentChanged.connect(() => {
      if (panel.isVisible) {
        void panel.poll.refresh();
      }
      status?.refreshNow();
    });
    // a kernel started, restarted elsewhere or changed: its GPU changes
    tracker?.widgetAdded.connect((_, widget) => {
      widget.sessionContext.kernelChanged.connect(() => status?.refreshNow());
    });
    if (settingRegistry) {
      settingRegistry
        .load(PLUGIN_ID)
        .then(settings => {
          panel.updateSettings(readSettings(settings));
          if (status !== null) {
            status.interval = Math.max(
              readSettings(settings).refreshInterval,
              2
            );
          }
          settings.changed.connect(() => {
            panel.updateSettings(readSettings(settings));
            if (status !== null) {
              status.interval = Math.max(
                readSettings(settings).refreshInterval,
                2
              );
            }
          });
        })
        .catch(reason => {
          console.error('autogpu: could not load the sidebar settings', reason);
        });
    }
  }
};

export default plugin;
